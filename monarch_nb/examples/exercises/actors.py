"""Exercises of notebooks/05-actors.ipynb: what actors hold, what a call gives back, what lives
on after a rank is lost."""

from __future__ import annotations

import math
from typing import Any

from monarch_nb.examples.exercises import checker, verdict


def _as_dict(answer: Any) -> dict | None:
    """An answer given as a dict, a ValueMesh-like ``.items()`` or a list (index = rank)."""
    if isinstance(answer, dict):
        return dict(answer)
    if hasattr(answer, "items"):
        try:
            return dict(answer.items())
        except Exception:  # a checker never raises
            return None
    if isinstance(answer, (list, tuple)):
        return dict(enumerate(answer))
    return None


@checker("replace ... with the value one counter holds after the calls")
def counter_after_calls(answer, start: int, calls: int, ranks: int) -> bool:
    """``calls`` times ``mesh.incr.call()`` (by 1) on counters spawned with ``start`` on ``ranks``
    ranks: each actor's value."""
    expected = start + calls
    if answer == start + calls * ranks:
        return verdict(
            False,
            f"each of the {ranks} actors holds its own value: a call reaches every actor once, "
            "it does not add to one shared counter",
        )
    if answer == calls and start != 0:
        return verdict(False, f"the counters were spawned with {start}, not 0")
    return verdict(
        answer == expected,
        f"every call adds 1 on every actor, each its own value: {start} + {calls} on each rank",
    )


@checker("replace ... with a dict {rank: value}, what the ValueMesh will hold")
def after_broadcasts(
    answer, start: int, first: int, sliced: int, broadcasts: int, ranks: int = 2
) -> bool:
    """Counters spawned with ``start``; ``incr.call(first)``;
    ``slice(gpus=1).incr.call_one(sliced)``; ``broadcasts`` times ``incr.broadcast()``; then
    ``incr.call(0).get()``: one value per rank."""
    common = start + first + broadcasts
    expected = {r: common + (sliced if r == 1 else 0) for r in range(ranks)}
    got = _as_dict(answer)
    if got is None:
        return verdict(False, "a ValueMesh holds one value per rank: answer with {rank: value}")
    if set(got) != set(expected):
        return verdict(
            False, f"the mesh has {ranks} actors, ranks {sorted(expected)}: one key each"[:200]
        )
    if got == expected:
        return verdict(
            True,
            f"a broadcast reaches every actor, so each gained {broadcasts}; the slice's "
            f"{sliced} went to rank 1 alone, so rank 1 stays {sliced} ahead",
        )
    if len(set(got.values())) == 1:
        return verdict(False, "slice(gpus=1) sent its increment to rank 1 only: the ranks differ")
    if got.get(0) == start + first + broadcasts // ranks:
        return verdict(
            False, "a broadcast is not split among the actors: each actor gets all of them"
        )
    return verdict(False, "add what reached each actor: the call, the slice's call, the broadcasts")


@checker("replace ... with the number of 'ping' lines")
def pings(answer, n: int) -> bool:
    """``players.slice(gpus=0).volley.call_one(players, n)``: how many of its lines are pings."""
    expected = math.ceil(n / 2)
    if answer == n // 2 and n % 2:
        return verdict(False, "player 0 serves: it plays the 1st, 3rd, 5th... of the n volleys")
    if answer == n:
        return verdict(False, "the players alternate: only every other line is player 0's")
    return verdict(
        answer == expected,
        f"n volleys, one line each, player 0 first and every other one after: ceil({n}/2)",
    )


@checker("replace ... with the number of gradient dicts the server averages each step")
def grads_per_step(answer, trainers: int) -> bool:
    """The parameter server's ``step()``: how many pushes it averages, ``trainers`` trainers."""
    if answer == trainers + 1:
        return verdict(False, "the parameter server computes no gradients: only trainers push")
    if answer == 1:
        return verdict(
            False, "every trainer pushes its own gradients before the server steps, on each rank"
        )
    return verdict(
        answer == trainers,
        f"one push per trainer, one trainer per rank of the mesh: {trainers}",
    )


STILL_ANSWER = {"a", "c"}


@checker('replace ... with a set of letters, e.g. {"a"}')
def still_answer(answer) -> bool:
    """After rank 1's worker was killed: which of the calls a-d still answer."""
    try:
        got = {str(x).strip().lower() for x in answer}
    except TypeError:
        got = set()
    if not got or not got <= {"a", "b", "c", "d"}:
        return verdict(False, 'answer with a set of the letters a to d, e.g. {"a", "b"}')
    if got == STILL_ANSWER:
        return verdict(
            True,
            "the actors on rank 0 live on, whatever their mesh; any call that includes rank 1 "
            "fails at once",
        )
    if "b" in got or "d" in got:
        return verdict(False, "a call that includes the dead rank 1 fails, even a whole-mesh call")
    if "c" not in got:
        return verdict(
            False,
            "fragile's rank-0 actor lives: only rank 1's process died, and an exception in an "
            "endpoint (the division by zero) does not kill an actor",
        )
    return verdict(False, "counters' rank-0 actor is on a process that is still alive")
