"""Exercises of lesson 09 (checkpoints and faults): what a resharded load reads, where a run
that lost a rank goes on from, and how often to save."""

from __future__ import annotations

import math

from monarch_nb.examples.exercises import checker, close, verdict


def _span(answer) -> tuple[int, int] | None:
    """``range(a, b)`` or ``(a, b)`` as ``(a, b)``; None for anything else."""
    if isinstance(answer, range) and answer.step == 1:
        return answer.start, answer.stop
    try:
        start, stop = answer
        return int(start), int(stop)
    except (TypeError, ValueError):
        return None


def _rows(rank: int, rows: int, ranks: int) -> tuple[int, int]:
    """The rows FSDP gives ``rank`` of ``ranks`` (torch.chunk: equal bands, rows divisible)."""
    band = rows // ranks
    return rank * band, (rank + 1) * band


@checker("replace ... with range(start, stop): the rows that rank loads")
def rows_loaded(answer, rank: int, rows: int, saved_by: int, loaded_by: int) -> bool:
    """The rows of a weight of ``rows`` rows that ``rank`` holds, and so reads, when a
    checkpoint saved by ``saved_by`` FSDP ranks is loaded by ``loaded_by``."""
    span = _span(answer)
    expected = _rows(rank, rows, loaded_by)
    why = (
        f"FSDP over {loaded_by} ranks cuts the {rows} rows into {loaded_by} bands of "
        f"{rows // loaded_by}; rank {rank} holds rows {expected[0]}-{expected[1] - 1} and reads "
        "just those, whoever saved them"
    )
    if span == expected:
        return verdict(True, why)
    if span == _rows(rank, rows, saved_by):
        why = (
            f"those are the rows rank {rank} held, and saved, at {saved_by} ranks; what it loads "
            f"is what it holds now, at {loaded_by} ranks: bands of {rows // loaded_by} rows"
        )
    elif span is None:
        why = "give the rows as range(start, stop), stop not included"
    elif span == (expected[0], expected[1] - 1):
        why = "almost: range(start, stop) leaves stop out, so stop is one past the last row"
    else:
        why = f"FSDP over {loaded_by} ranks gives each rank one band of {rows} / {loaded_by} rows"
    return verdict(False, why)


@checker("replace ... with a set of ranks, such as {0, 1}: whose saved shards that rank reads")
def shards_read(answer, rank: int, saved_by: int, loaded_by: int) -> bool:
    """Which of the ``saved_by`` ranks' shards ``rank`` reads when ``loaded_by`` ranks load
    their checkpoint (equal bands of rows, ``loaded_by`` dividing ``saved_by``)."""
    per = saved_by // loaded_by
    expected = set(range(rank * per, (rank + 1) * per))
    try:
        given = {int(r) for r in answer}
    except (TypeError, ValueError):
        given = None
    why = (
        f"each of the {loaded_by} ranks now holds {per} of the {saved_by} saved bands: rank {rank} "
        f"reads the shards saved by ranks {sorted(expected)}, DCP matching their rows to its own"
    )
    if given == expected:
        return verdict(True, why)
    if given is None:
        why = "give a set of ranks, such as {0, 1}"
    elif given == {rank}:
        why = (
            f"rank {rank}'s own saved shard is one band of {saved_by}; at {loaded_by} ranks it "
            f"holds {per} bands, so it reads {per} saved shards"
        )
    elif len(given) != per:
        why = f"rank {rank} holds {saved_by} / {loaded_by} of the saved bands now: count them"
    else:
        why = "the bands are in rank order: rank r at the new size holds saved bands r*k to r*k+k-1"
    return verdict(False, why)


@checker("replace ... with the step the loop loads and goes on from")
def resume_step(answer, every: int, killed_at: int) -> bool:
    """The step a loop that saves after every ``every`` steps (``step=`` the steps done so far)
    goes on from, when a rank was killed as step ``killed_at`` began."""
    expected = killed_at // every * every
    why = (
        f"saves are at steps {every}, {2 * every}, ... (the steps done); the last one before "
        f"step {killed_at} began is {expected}, so the loop loads it and runs step {expected} next"
    )
    if close(answer, expected, rel=0) and not isinstance(answer, bool):
        return verdict(True, why)
    if close(answer, killed_at, rel=0):
        why = "the steps since the last checkpoint died with the ranks' memory: go back to a save"
    elif close(answer, expected - every, rel=0):
        why = f"one save too early: the save at {expected} finished before the kill"
    elif close(answer, expected + every, rel=0):
        why = f"the save at {expected + every} never happened: the rank died before that step"
    else:
        why = f"a save happens after steps {every}, {2 * every}, ...: which is the last before "
        why += f"{killed_at}?"
    return verdict(False, why)


@checker("replace ... with how many steps were computed and then thrown away")
def steps_lost(answer, every: int, killed_at: int) -> bool:
    """How many steps a kill as step ``killed_at`` began throws away, with a save after every
    ``every`` steps."""
    expected = killed_at % every
    last = killed_at - expected
    if expected:
        why = f"the last save was after step {last - 1}: steps {last} to {killed_at - 1} are "
        why += f"done again, {expected} = {killed_at} mod {every}"
    else:
        why = f"the save of step {last} had just finished: nothing is done again"
    if close(answer, expected, rel=0) and not isinstance(answer, bool):
        return verdict(True, why)
    if close(answer, expected + 1, rel=0):
        why = f"step {killed_at} had not run yet when the rank was killed: it is not lost"
    elif close(answer, every, rel=0):
        why = f"at most {every - 1} can be lost: once {every} steps have run, their save is done"
    else:
        why = "count the steps after the last save and before the kill"
    return verdict(False, why)


@checker("replace ... with the interval in seconds, by Young's formula")
def young_interval(answer, save_s: float, mtbf_s: float) -> bool:
    """Young's interval between checkpoints, sqrt(2 * save time * mean time between failures):
    where the time spent saving equals the time expected to be lost to failures."""
    expected = math.sqrt(2 * save_s * mtbf_s)
    why = (
        f"sqrt(2 x {save_s:g} s x {mtbf_s:g} s) = {expected:.0f} s: saving more often costs more "
        "in saves than it saves in recomputation, less often the other way round"
    )
    if close(answer, expected, rel=0.05):
        return verdict(True, why)
    if close(answer, math.sqrt(save_s * mtbf_s), rel=0.05):
        why = "the factor 2 is missing: on average a failure loses half an interval"
    elif close(answer, 2 * save_s * mtbf_s, rel=0.05):
        why = "that is the square of it: take the square root"
    else:
        why = "Young's formula: the square root of 2 x save time x time between failures"
    return verdict(False, why)
