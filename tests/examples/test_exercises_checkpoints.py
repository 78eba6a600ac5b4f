"""Lesson 09's checkers (monarch_nb.examples.exercises.checkpoints): a right answer, and the
likely wrong ones with the line that says why."""

from __future__ import annotations

import pytest

from monarch_nb.examples.exercises import checkpoints as check


def said(capsys) -> str:
    return capsys.readouterr().out.strip()


def test_rows_loaded(capsys):
    args = dict(rank=1, rows=128, saved_by=4, loaded_by=2)
    assert check.rows_loaded(range(64, 128), **args)
    assert said(capsys).startswith("right: FSDP over 2 ranks cuts the 128 rows into 2 bands")
    assert check.rows_loaded((64, 128), **args)
    said(capsys)
    # the rows rank 1 saved at 4 ranks, not those it holds at 2
    assert not check.rows_loaded(range(32, 64), **args)
    assert said(capsys) == (
        "not quite: those are the rows rank 1 held, and saved, at 4 ranks; what it loads is what "
        "it holds now, at 2 ranks: bands of 64 rows"
    )
    assert not check.rows_loaded((64, 127), **args)  # the last row, not one past it
    assert said(capsys).startswith("not quite: almost: range(start, stop) leaves stop out")
    assert not check.rows_loaded("rows 64 to 127", **args)
    assert said(capsys) == "not quite: give the rows as range(start, stop), stop not included"


def test_shards_read(capsys):
    args = dict(rank=1, saved_by=4, loaded_by=2)
    assert check.shards_read({2, 3}, **args)
    assert said(capsys).startswith("right: each of the 2 ranks now holds 2 of the 4 saved bands")
    assert not check.shards_read({1}, **args)  # its own old shard
    assert said(capsys) == (
        "not quite: rank 1's own saved shard is one band of 4; at 2 ranks it holds 2 bands, so "
        "it reads 2 saved shards"
    )
    assert not check.shards_read({1, 2}, **args)
    assert said(capsys).startswith("not quite: the bands are in rank order")
    assert not check.shards_read({0, 1, 2, 3}, **args)
    assert said(capsys) == "not quite: rank 1 holds 4 / 2 of the saved bands now: count them"


def test_resume_step(capsys):
    assert check.resume_step(8, every=4, killed_at=11)
    assert said(capsys).startswith("right: saves are at steps 4, 8, ... (the steps done)")
    assert not check.resume_step(11, every=4, killed_at=11)  # from memory, not from disk
    assert said(capsys) == (
        "not quite: the steps since the last checkpoint died with the ranks' memory: go back to "
        "a save"
    )
    assert not check.resume_step(12, every=4, killed_at=11)
    assert said(capsys) == (
        "not quite: the save at 12 never happened: the rank died before that step"
    )
    assert not check.resume_step(4, every=4, killed_at=11)
    assert said(capsys) == "not quite: one save too early: the save at 8 finished before the kill"
    assert not check.resume_step(True, every=1, killed_at=1)  # a bool is no step
    said(capsys)


def test_steps_lost(capsys):
    assert check.steps_lost(3, every=4, killed_at=11)
    assert said(capsys) == (
        "right: the last save was after step 7: steps 8 to 10 are done again, 3 = 11 mod 4"
    )
    assert not check.steps_lost(4, every=4, killed_at=11)  # step 11 counted as run
    assert said(capsys) == (
        "not quite: step 11 had not run yet when the rank was killed: it is not lost"
    )
    assert check.steps_lost(0, every=4, killed_at=8)
    assert said(capsys) == "right: the save of step 8 had just finished: nothing is done again"
    assert not check.steps_lost(4, every=4, killed_at=8)
    assert said(capsys) == (
        "not quite: at most 3 can be lost: once 4 steps have run, their save is done"
    )


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (
            (60 * 43200) ** 0.5,
            "the factor 2 is missing: on average a failure loses half an interval",
        ),
        (2 * 60 * 43200, "that is the square of it: take the square root"),
        (3600, "Young's formula: the square root of 2 x save time x time between failures"),
    ],
)
def test_young_interval(capsys, answer, why):
    assert check.young_interval(2277, save_s=60, mtbf_s=43200)
    assert said(capsys).startswith("right: sqrt(2 x 60 s x 43200 s) = 2277 s")
    assert not check.young_interval(answer, save_s=60, mtbf_s=43200)
    assert said(capsys) == f"not quite: {why}"


def test_unanswered_says_so(capsys):
    assert not check.resume_step(..., every=4, killed_at=11)
    assert said(capsys).startswith("not answered yet: ")
