"""Exercises of notebooks/02-working-with-the-cluster.ipynb: moving data, errors, background
cells, post-mortem debugging and a kept cluster."""

from __future__ import annotations

from typing import Any

from monarch_nb.examples.exercises import checker, verdict


def _chunk(n: int, parts: int, index: int) -> list[int]:
    """The items of ``list(range(n))`` that scatter gives rank ``index`` of ``parts``: contiguous,
    sizes differing by at most 1, the larger first (monarch_nb.controller.data.chunk_bounds)."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return list(range(start, start + size + (index < extra)))


def _number(answer: Any) -> float | None:
    try:
        return float(answer)
    except (TypeError, ValueError):
        return None


@checker("replace ... with the list rank 1 holds")
def scatter_shard(answer, n: int, world_size: int, rank: int) -> bool:
    """What ``%monarch scatter shard list(range(n))`` leaves on ``rank`` of ``world_size``."""
    expected = _chunk(n, world_size, rank)
    try:
        got = list(answer)
    except TypeError:
        return verdict(False, "shard is a list: a piece of the sequence")
    if got == expected:
        return verdict(True, "scatter splits into contiguous pieces, one per rank, in rank order")
    if got == list(range(n))[rank::world_size]:
        return verdict(False, "that is every other item; scatter's pieces are contiguous")
    if got == list(range(n)):
        return verdict(False, "that is push; scatter gives each rank a piece")
    return verdict(False, f"{n} items over {world_size} ranks, in rank order")


@checker("replace ... with the number rank 0 returned")
def partial_value(answer) -> bool:
    """Rank 0's value in ``partial`` after ``values[rank] / (rank - 1)``, values = [1.0, 2.0]."""
    got = _number(answer)
    if got == -1.0:
        return verdict(True, "rank 0 computed 1.0 / (0 - 1) and kept its result")
    if got == 1.0:
        return verdict(False, "rank 0 divides by rank - 1, which is -1 there")
    if got is None:
        return verdict(False, "rank 0 did not fail: only rank 1 divided by zero")
    return verdict(False, "work out values[0] / (0 - 1)")


@checker("replace ... with the values, in rank order, e.g. [a, b]")
def background_result(answer) -> bool:
    """What ``job.result()`` holds: the background cell ends with ``rank * 100`` on 2 ranks."""
    got = answer
    if hasattr(got, "values") and callable(got.values):
        got = list(got.values())
    try:
        got = [float(v) for v in got]
    except (TypeError, ValueError):
        return verdict(False, "the result is a ValueMesh: one value per rank, as a list")
    if got == [0.0, 100.0]:
        return verdict(True, "the cell's last expression, per rank, as a blocking cell's")
    if got == [2.0, 2.0]:
        return verdict(False, "the printed steps are output; the result is the last expression")
    return verdict(False, "evaluate rank * 100 on each rank")


@checker("replace ... with what p scaled prints")
def debug_scaled(answer) -> bool:
    """What ``p scaled`` prints in rank 1's frame: ``ratio(rank + 1)`` with ``scaled = v * 10``."""
    got = _number(answer)
    if got == 20:
        return verdict(True, "rank 1 called ratio(2), so scaled = 20 before the division failed")
    if got == 10:
        return verdict(False, "v is rank + 1, which is 2 on rank 1")
    if got == 0:
        return verdict(False, "pdb opens on rank 1, the rank that failed")
    return verdict(False, "the debugger opens in rank 1's ratio(v) with v = rank + 1")


@checker("replace ... with the number rank 1 returns")
def kept_sum(answer) -> bool:
    """``weights.sum()`` on rank 1 after detach and attach: ``torch.full((3,), float(rank))``."""
    got = _number(answer)
    if got == 3.0:
        return verdict(True, "the kept cluster kept rank 1's weights: 3 entries of 1.0")
    if got is None:
        return verdict(False, "the ranks' namespaces outlive the detach: weights is still there")
    if got == 1.0:
        return verdict(False, "weights has 3 entries")
    return verdict(False, "weights is torch.full((3,), float(rank)) on each rank")


@checker("replace ... with a dict {rank: value}")
def targeted_values(answer) -> bool:
    """``%%monarch --targets 1`` on 2 ranks, ending with ``rank * 7``: its ValueMesh."""
    got = dict(answer.items()) if hasattr(answer, "items") else answer
    if got == {1: 7}:
        return verdict(True, "only rank 1 ran the cell, so the ValueMesh has rank 1's value alone")
    if got in ({0: 0, 1: 7}, [0, 7]):
        return verdict(False, "--targets 1 runs the cell on rank 1 only: rank 0 returns nothing")
    if got == 7:
        return verdict(False, "a cell returns a ValueMesh, keyed by rank, even from one rank")
    return verdict(False, "which ranks run the cell, and what rank * 7 is there")


@checker("replace ... with what out holds on rank 1")
def shell_lines(answer) -> bool:
    """``out = !echo {rank}`` on rank 1: the command's output, as a list of lines."""
    if answer == ["1"]:
        return verdict(True, "out = !cmd keeps the output's lines, strings, in a list")
    if answer in ("1", "1\n"):
        return verdict(False, "out = !cmd keeps a list of lines, not one string")
    if answer in ([1], 1):
        return verdict(False, "a shell's output is text: the lines are strings")
    return verdict(False, "{rank} is replaced by the rank's value before the shell runs")


@checker("replace ... with True or False")
def count_survives(answer) -> bool:
    """After ``--timeout 2`` interrupted ``count += 1`` in a loop: does ``count > 0`` on every
    rank (the namespace survives an interrupt, with what the loop did)."""
    if answer is True:
        return verdict(True, "an interrupt stops the cell, not the rank: count keeps its value")
    if answer is False:
        return verdict(
            False, "the interrupt ends the loop, not the process: the namespace keeps count"
        )
    return verdict(False, "answer True or False")


@checker("replace ... with a number")
def workers_after_down(answer, started: int = 2) -> bool:
    """After ``%monarch down`` of a cluster ``%monarch up`` started: its workers still running."""
    if answer == 0 and answer is not False:
        return verdict(True, "down stops the workers the notebook started (and their scheduler)")
    if answer == started:
        return verdict(
            False, "that is %monarch connect's cluster, which down leaves to its owner; up's goes"
        )
    return verdict(False, "what %monarch down does to a cluster %monarch up started")
