"""Exercises of lesson 08 (model parallelism): count tensor parallelism's all-reduces, predict a
GPipe pipeline's bubble, say which ranks hold a 2-D layer norm's entry, count the Monarch model's
all-to-alls, and say whose bytes grow with the batch."""

from __future__ import annotations

from monarch_nb.examples.exercises import checker, close, verdict
from monarch_nb.examples.exercises.data_parallel import _ranks

STRATEGIES = {"DDP", "FSDP", "TP", "PP"}


@checker("replace ... with the number of all-reduces, forward and backward together")
def tp_all_reduces(answer, blocks=4):
    """Per block: one all-reduce after each row-wise layer forward (o, down), and one for the
    input gradient of each column-wise layer backward (q, k, v, up)."""
    expected = 6 * blocks
    if close(answer, 8 * blocks, 0):
        return verdict(
            False,
            "not four each way: a row-wise layer's backward needs no "
            "all-reduce, but each of the four column-wise layers' input gradients does",
        )
    if close(answer, 2 * blocks, 0):
        return verdict(
            False,
            "that is the forward pass only: the backward pass sums the input "
            "gradients of the column-wise layers",
        )
    return verdict(
        close(answer, expected, 0),
        f"2 forward (after o and down) and 4 backward "
        f"(q, k, v, up) a block, {blocks} blocks: {expected}",
    )


@checker("replace ... with the share of a step a stage waits, e.g. 0.25")
def bubble(answer, stages=4, micro=4):
    """A GPipe (or 1F1B) schedule's bubble, forward and backward one slot each: (p-1)/(m+p-1),
    the same for both: 1F1B holds fewer micro-batches' activations, it does not wait less."""
    expected = (stages - 1) / (micro + stages - 1)
    if close(answer, (stages - 1) / micro):
        return verdict(
            False,
            "that is the waiting over the work; as a share of the whole step "
            "(work and waiting) the denominator is m + p - 1",
        )
    try:
        other = 0 < float(answer) < 1 and not close(answer, expected)
    except (TypeError, ValueError):
        other = False
    if other:
        return verdict(
            False,
            "GPipe and 1F1B wait alike: 1F1B starts backwards earlier so that fewer "
            "activations are held, but each stage still waits p - 1 slots of m + p - 1 "
            "each way",
        )
    return verdict(
        close(answer, expected),
        f"(p-1)/(m+p-1) = {stages - 1}/{micro + stages - 1}, for GPipe and 1F1B alike",
    )


@checker("replace ... with the set of ranks, e.g. {0, 2}")
def norm_holders(answer, entry, size=32, dp=2, tp=2):
    """On a dp x tp mesh (rank = d * tp + t), TP leaves a layer norm whole and FSDP halves it
    over dp: entry e is held by the tp ranks of dp coordinate e // (size / dp)."""
    d = entry // (size // dp)
    expected = {d * tp + t for t in range(tp)}
    got = _ranks(answer)
    if got == set(range(dp * tp)):
        return verdict(False, "TP leaves the layer norm whole, but FSDP still shards it over dp")
    if got and len(got) == 1:
        return verdict(
            False,
            "only TP's split would give a rank its own entries, and TP "
            "leaves the layer norm whole: the tp ranks of a row share it",
        )
    return verdict(
        got == expected,
        f"FSDP's half {d} (dp={d}) of {size // dp} entries, on both tp ranks of that row",
    )


@checker("replace ... with the number of all-to-alls")
def monarch_all_to_alls(answer, layers=2):
    """Each Monarch layer split by blocks runs one all-to-all forward (the permutation between
    its factors) and one backward (the same permutation of the gradient)."""
    if close(answer, layers, 0):
        return verdict(
            False,
            "that is the forward pass: the backward pass permutes the "
            "gradient back, one all-to-all a layer again",
        )
    return verdict(
        close(answer, 2 * layers, 0), f"one a layer each way, {layers} layers: {2 * layers}"
    )


@checker('replace ... with a set of names, e.g. {"DDP"}')
def grows_with_batch(answer):
    """Whose bytes a step grow with the batch: those that send activations (TP, PP), not those
    that send parameters and gradients (DDP, FSDP)."""
    try:
        got = {str(a).upper() for a in answer} if not isinstance(answer, str) else {answer}
    except TypeError:
        got = set()
    if got & {"DDP", "FSDP"}:
        return verdict(
            False,
            "DDP and FSDP send gradients and parameters: their size is the "
            "model's, whatever the batch",
        )
    return verdict(
        got == {"TP", "PP"},
        "TP's all-reduces and PP's sends carry activations, whose size is the batch's",
    )
