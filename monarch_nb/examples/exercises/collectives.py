"""Exercises of notebooks/01-ranks-and-collectives.ipynb: ranks, their namespaces, and what an
all-reduce, a broadcast and an all-gather leave on each rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from monarch_nb.examples.exercises import checker, verdict


def _per_rank(answer: Any) -> list | None:
    """An answer given per rank (a list in rank order, a dict or a ValueMesh) as a list."""
    if hasattr(answer, "values") and callable(answer.values):
        answer = list(answer.values()) if not isinstance(answer, dict) else answer
    if isinstance(answer, dict):
        try:
            return [answer[r] for r in sorted(answer)]
        except TypeError:
            return None
    if isinstance(answer, list | tuple):
        return list(answer)
    return None


def _number(answer: Any) -> float | None:
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


@checker("replace ... with the values, in rank order, e.g. [a, b, c, d]")
def last_value(answer, world_size: int) -> bool:
    """What a cell ending in ``world_size - rank`` returns: one value per rank."""
    expected = [world_size - r for r in range(world_size)]
    got = _per_rank(answer)
    if got == expected:
        return verdict(True, f"each rank evaluates the expression with its own rank: {expected}")
    if got is None:
        return verdict(False, "a ValueMesh holds one value per rank: give a list in rank order")
    if got == list(range(world_size)) or got == expected[::-1]:
        return verdict(False, "rank 0 has the largest value here: world_size - 0")
    if len(got) != world_size:
        return verdict(False, f"there is one value per rank, {world_size} in all")
    return verdict(False, "every rank runs the same expression with its own `rank`")


@checker("replace ... with the number rank 3 holds")
def namespace_value(answer, rank: int) -> bool:
    """``total = rank`` in one cell, ``total = total * 10 + 1`` in the next: what ``rank`` holds."""
    expected = rank * 10 + 1
    got = _number(answer)
    if got == expected:
        return verdict(True, f"the second cell finds the first cell's total ({rank}): {expected}")
    if got == 1:
        return verdict(False, "the first cell's `total` is still there: namespaces persist")
    if got == rank:
        return verdict(False, "the second cell ran too, on the value the first one left")
    return verdict(False, "each rank keeps its own total, starting from its own rank")


@checker("replace ... with the number every rank holds after the all-reduce")
def all_reduce_sum(answer, values: Sequence[float]) -> bool:
    """What every rank holds after ``dist.all_reduce`` (sum) of one number per rank."""
    expected = float(sum(values))
    if _per_rank(answer) is not None:
        return verdict(False, "every rank holds the same number after an all-reduce: give one")
    got = _number(answer)
    if got == expected:
        return verdict(True, f"the sum of every rank's value, {expected:g}, on every rank")
    if got in [float(v) for v in values]:
        return verdict(False, "that is one rank's own value; an all-reduce combines all of them")
    if got == expected / len(values):
        return verdict(False, "that is the mean: all_reduce sums (ReduceOp.SUM) by default")
    return verdict(False, "add up the value of every rank")


@checker("replace ... with the number rank 3 holds after the broadcast")
def broadcast_value(answer, values: Sequence[float], src: int, rank: int) -> bool:
    """What ``rank`` holds after ``dist.broadcast(t, src=src)``; ``values``: each rank's t."""
    expected = float(values[src])
    got = _number(answer)
    if got == expected:
        return verdict(True, f"a broadcast overwrites every rank's tensor with rank {src}'s")
    if got == float(values[rank]):
        return verdict(False, f"rank {rank}'s own value is overwritten by the broadcast")
    if got == float(sum(values)):
        return verdict(False, "that is an all-reduce; a broadcast copies one rank's tensor")
    return verdict(False, f"look at what the source, rank {src}, holds")


@checker("replace ... with the list rank 2 holds after the all-gather")
def all_gather_list(answer, values: Sequence[float]) -> bool:
    """What any rank holds after ``dist.all_gather`` of one number per rank."""
    expected = [float(v) for v in values]
    got = _per_rank(answer)
    try:
        got = None if got is None else [float(v) for v in got]
    except (TypeError, ValueError):
        got = None
    if got == expected:
        return verdict(True, "every rank gets every rank's value, in rank order")
    if got is None:
        return verdict(False, "an all-gather leaves a list on each rank: give a list")
    if sorted(got) == sorted(expected):
        return verdict(False, "the values are right; they come in rank order")
    if len(got) != len(expected):
        return verdict(False, f"there is one entry per rank, {len(expected)} in all")
    return verdict(False, "each entry is what that rank contributed")


@checker("replace ... with a set of ranks, e.g. {0, 1}")
def stuck_ranks(answer, calls: Callable[[int], bool], world_size: int) -> bool:
    """Which ranks wait for ever when only the ranks where ``calls(rank)`` call all_reduce."""
    callers = {r for r in range(world_size) if calls(r)}
    expected = callers if len(callers) < world_size else set()
    try:
        got = set(answer)
    except TypeError:
        return verdict(False, "give a set of ranks, e.g. {0, 1}, or set() for none")
    if got == expected:
        why = "the ranks that call all_reduce wait for the ones that never do"
        return verdict(True, why if expected else "every rank calls it: nobody waits")
    if expected and got == set(range(world_size)) - callers:
        return verdict(False, "the ranks that skip the collective finish the cell; who waits?")
    if not expected:
        return verdict(False, "check the condition for each rank: does any rank skip it?")
    return verdict(False, "a rank waits where it called all_reduce and some peer never will")


@checker("replace ... with a list of pairs, in rank order")
def group_identity(answer, world_size: int) -> bool:
    """What ``(dist.get_rank(), dist.get_world_size())`` returns on each of ``world_size`` ranks
    of the group ``%monarch up`` formed."""
    expected = [(r, world_size) for r in range(world_size)]
    try:
        got = [tuple(p) for p in (answer.values() if hasattr(answer, "values") else answer)]
    except TypeError:
        return verdict(False, "one pair a rank, in rank order")
    if got == expected:
        return verdict(True, "the group's ranks are monarch-nb's ranks, and it holds all of them")
    if got == [(0, world_size)] * world_size:
        return verdict(False, "each process is a different rank of the group")
    if got == [(r, 1) for r in range(world_size)]:
        return verdict(False, "the world size counts every rank of the group, not this one")
    return verdict(False, "dist.get_rank() is the cell's rank; dist.get_world_size() the count")
