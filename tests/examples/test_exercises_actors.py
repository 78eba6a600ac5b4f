"""The checkers of notebooks/05-actors.ipynb: a right answer, and the likely wrong ones with the
reason each is given."""

from __future__ import annotations

import pytest

from monarch_nb.examples.exercises import actors as check

BROADCASTS = dict(start=100, first=5, sliced=10, broadcasts=1000)


def said(capsys) -> str:
    return capsys.readouterr().out.strip()


def test_after_broadcasts(capsys):
    assert check.after_broadcasts({0: 1105, 1: 1115}, **BROADCASTS)
    assert said(capsys).startswith("right: a broadcast reaches every actor")
    assert check.after_broadcasts([1105, 1115], **BROADCASTS)  # a list, by rank
    said(capsys)
    assert not check.after_broadcasts({0: 1105, 1: 1105}, **BROADCASTS)
    assert said(capsys) == (
        "not quite: slice(gpus=1) sent its increment to rank 1 only: the ranks differ"
    )
    assert not check.after_broadcasts({0: 605, 1: 615}, **BROADCASTS)
    assert "not split among the actors" in said(capsys)
    assert not check.after_broadcasts(1105, **BROADCASTS)
    assert said(capsys).startswith("not quite: a ValueMesh holds one value per rank")


def test_counter_after_calls(capsys):
    assert check.counter_after_calls(7, start=0, calls=7, ranks=2)
    assert said(capsys).startswith("right: ")
    assert not check.counter_after_calls(14, start=0, calls=7, ranks=2)
    assert said(capsys).startswith("not quite: each of the 2 actors holds its own value")
    assert not check.counter_after_calls(7, start=100, calls=7, ranks=2)
    assert said(capsys) == "not quite: the counters were spawned with 100, not 0"


def test_pings(capsys):
    assert check.pings(4, n=7)
    assert said(capsys).startswith("right: ")
    assert not check.pings(3, n=7)
    assert said(capsys).startswith("not quite: player 0 serves")
    assert not check.pings(7, n=7)
    assert said(capsys).startswith("not quite: the players alternate")


def test_grads_per_step(capsys):
    assert check.grads_per_step(2, trainers=2)
    assert said(capsys).startswith("right: one push per trainer")
    assert not check.grads_per_step(3, trainers=2)
    assert "computes no gradients" in said(capsys)
    assert not check.grads_per_step(1, trainers=2)
    assert "every trainer pushes" in said(capsys)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"a", "b", "c"}, "a call that includes the dead rank 1 fails"),
        ({"a"}, "fragile's rank-0 actor lives"),
        ({"c"}, "counters' rank-0 actor is on a process that is still alive"),
        ("x", "answer with a set of the letters a to d"),
        (None, "answer with a set of the letters a to d"),
    ],
)
def test_still_answer_wrong(capsys, answer, why):
    assert not check.still_answer(answer)
    out = said(capsys)
    assert out.startswith("not quite: ") and why in out, out


def test_still_answer_right(capsys):
    assert check.still_answer({"A", "c"})
    assert said(capsys).startswith("right: the actors on rank 0 live on")
