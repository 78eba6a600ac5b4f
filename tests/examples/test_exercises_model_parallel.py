"""The checkers of lesson 08 (model parallelism): a right answer and likely wrong ones, each
with the why it prints."""

from __future__ import annotations

from _exercise_checks import said

from monarch_nb.examples.exercises import model_parallel as check
from monarch_nb.examples.parallel_costs import bubble, in_flight, schedule


def verdict(capsys, right, answer, f, **kwargs):
    return said(capsys, right, f, answer, **kwargs)


def test_tp_all_reduces(capsys):
    verdict(capsys, True, 24, check.tp_all_reduces, blocks=4)
    assert "not four each way" in verdict(capsys, False, 32, check.tp_all_reduces, blocks=4)
    assert "forward pass only" in verdict(capsys, False, 8, check.tp_all_reduces, blocks=4)


def test_bubble(capsys):
    verdict(capsys, True, 3 / 7, check.bubble, stages=4, micro=4)
    out = verdict(capsys, False, 0.2, check.bubble, stages=4, micro=4)
    assert "GPipe and 1F1B wait alike" in out
    assert "denominator is m + p - 1" in verdict(capsys, False, 0.75, check.bubble)


def test_the_drawn_schedules_wait_the_formulas_bubble():
    for kind in ("GPipe", "1F1B"):
        for stages, micro in ((4, 4), (2, 6), (4, 8)):
            slots = schedule(kind, stages, micro)
            assert len(slots[0]) == 2 * (micro + stages - 1)
            for row in slots:
                assert sum(s is None for s in row) / len(row) == bubble(stages, micro)
    assert [in_flight(r) for r in schedule("1F1B", 4, 8)] == [4, 3, 2, 1]
    assert [in_flight(r) for r in schedule("GPipe", 4, 8)] == [8] * 4


def test_norm_holders(capsys):
    verdict(capsys, True, {2, 3}, check.norm_holders, entry=20, size=32, dp=2, tp=2)
    out = verdict(capsys, False, {0, 1, 2, 3}, check.norm_holders, entry=20)
    assert "FSDP still shards it over dp" in out
    assert "TP leaves the layer norm whole" in verdict(
        capsys, False, {2}, check.norm_holders, entry=20
    )
    verdict(capsys, False, {0, 1}, check.norm_holders, entry=20)


def test_monarch_all_to_alls(capsys):
    verdict(capsys, True, 4, check.monarch_all_to_alls, layers=2)
    assert "the forward pass" in verdict(capsys, False, 2, check.monarch_all_to_alls, layers=2)


def test_grows_with_batch(capsys):
    verdict(capsys, True, {"TP", "PP"}, check.grows_with_batch)
    assert "the model's, whatever the batch" in verdict(
        capsys, False, {"TP", "DDP"}, check.grows_with_batch
    )
    verdict(capsys, False, {"TP"}, check.grows_with_batch)
