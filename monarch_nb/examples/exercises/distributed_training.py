"""Checkers for notebooks/04-distributed-training.ipynb: what each rank reads, what DDP does to
the ranks' weights, and how many samples a step trains on."""

from __future__ import annotations

import math

from monarch_nb.examples.exercises import checker, close, verdict


@checker("replace ... with the number of samples one rank sees in an epoch")
def samples_per_rank(answer, n: int, world_size: int, drop_last: bool = False) -> bool:
    """``DistributedSampler`` over ``n`` samples: ⌈n / world_size⌉ a rank, padded by repeating
    samples, or ⌊n / world_size⌋ with ``drop_last=True``."""
    up, down = math.ceil(n / world_size), n // world_size
    expected, other = (down, up) if drop_last else (up, down)
    if close(answer, expected, 0):
        how = "drops the tail" if drop_last else "pads by repeating samples"
        return verdict(
            True,
            f"{expected} a rank: the sampler {how} so that every rank has as "
            "many (and so as many steps: a rank with fewer would leave the others "
            "waiting in the all-reduce)",
        )
    if close(answer, n, 0):
        return verdict(False, "that is the whole split: each rank sees its own share of it")
    if close(answer, other, 0) and up != down:
        how = (
            "drop_last=True drops"
            if drop_last
            else "with drop_last=False it pads, it does not drop"
        )
        return verdict(False, f"every rank gets the same count, but {how} the remainder")
    return verdict(False, f"the {n} samples are dealt out to {world_size} ranks in turn")


@checker("replace ... with the number of different samples one step trains on, over all ranks")
def distinct_samples(answer, batch: int, world_size: int) -> bool:
    """Every rank drawing the same batch: one step trains on ``batch`` different samples, however
    many ranks compute it."""
    if close(answer, batch, 0):
        return verdict(
            True,
            f"{batch}: every rank computes the same {batch} samples, so "
            f"{world_size} ranks do {world_size} times the work of one for its gradient",
        )
    if close(answer, batch * world_size, 0):
        return verdict(
            False,
            "that is what sharded ranks train on; these ranks draw the same "
            "indices, so their batches are copies",
        )
    return verdict(False, "compare the ranks' checksums: how many of their batches differ?")


_YES, _NO = {"yes", "y", "true", "differ"}, {"no", "n", "false", "same", "agree"}


def _yes_no(answer) -> bool | None:
    if isinstance(answer, bool):
        return answer
    text = str(answer).strip().lower()
    return True if text in _YES else False if text in _NO else None


@checker("replace ... with True (the weights differ) or False (they agree)")
def weights_differ_after_step(answer, wrapper: str = "DDP") -> bool:
    """Ranks seeded differently, one step with ``wrapper``: DDP's weights agree (it broadcasts
    rank 0's when built), FSDP2's differ (it broadcasts nothing)."""
    said = _yes_no(answer)
    if said is None:
        return verdict(False, "answer True (they differ) or False (they agree)")
    differ = wrapper.upper() != "DDP"
    if said == differ and not differ:
        return verdict(
            True,
            "they agree: DDP broadcasts rank 0's parameters and buffers when it "
            "is built, and every step applies the same averaged gradient everywhere",
        )
    if said == differ:
        return verdict(
            True,
            "they differ: fully_shard broadcasts nothing, so each rank keeps "
            "its own draw of its shard; seed alike, or load one checkpoint everywhere",
        )
    if differ:
        return verdict(
            False,
            "FSDP2's fully_shard broadcasts nothing: each rank's shard is the "
            "one it drew itself, and nothing says so",
        )
    return verdict(
        False,
        "the seeds differ, but DDP(model) broadcasts rank 0's weights as it "
        "is built, and the averaged gradients are the same on every rank",
    )


@checker("replace ... with the number of samples behind one step's gradient")
def global_batch(answer, batch: int, world_size: int) -> bool:
    """DDP averages every rank's gradient: a step's gradient is the mean over batch * world_size
    samples."""
    expected = batch * world_size
    if close(answer, expected, 0):
        return verdict(
            True,
            f"{batch} a rank times {world_size} ranks = {expected}: the "
            "all-reduce averages the ranks' gradients into one over all their samples",
        )
    if close(answer, batch, 0):
        return verdict(
            False,
            "that is one rank's batch; DDP averages the gradients of every "
            "rank's batch before the step",
        )
    return verdict(False, "each rank computes a gradient on its own batch, then they are averaged")
