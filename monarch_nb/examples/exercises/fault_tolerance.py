"""Exercises of notebooks/10-fault-tolerance.ipynb: what a replacement rank trains on and from
which step, how many ranks a quorum has after a kill, what a checkpoint costs, and the outcome of
losing two ranks one after the other."""

from __future__ import annotations

from monarch_nb.examples.exercises import checker, verdict


@checker("replace ... with the number of samples in the replacement's shard")
def shard_size(answer, rank: int, world_size: int, samples: int) -> bool:
    """``x_all[rank::world_size]`` of ``samples`` samples, run again by rank ``rank``'s
    replacement in a world of ``world_size``: how many samples."""
    expected = len(range(rank, samples, world_size))
    if answer == len(range(rank, samples, world_size - 1)):
        return verdict(
            False,
            f"the replacement runs the setup cell as rank {rank} of {world_size}: the world "
            "did not shrink for it",
        )
    return verdict(
        answer == expected,
        f"the same shard rank {rank} had: every {world_size}th sample from {rank}, "
        f"len(range({rank}, {samples}, {world_size}))",
    )


@checker("replace ... with the number of ranks in the quorum")
def quorum_after_kill(answer, world: int, killed: int) -> bool:
    """``world`` ranks train, ``killed`` of them are killed: how many take part in the next
    quorum, before any replacement is back."""
    expected = world - killed
    if answer == world:
        return verdict(
            False,
            "the killed rank's heartbeats stop and the Lighthouse forms the next quorum without "
            "it; it takes part again only after its replacement has healed",
        )
    if answer == 0:
        return verdict(False, "with torchft the survivors go on: nothing stops")
    return verdict(answer == expected, f"the survivors, {world} - {killed}, until it is back")


HEALS = {
    "a": "step 0, the loop's first step",
    "b": "the step rank 2 was lost at",
    "c": "the step the others are at when it joins",
}


@checker('replace ... with "a", "b" or "c"')
def heals_from(answer) -> bool:
    """From which step the replacement rank trains: a, b or c (``HEALS``)."""
    got = str(answer).strip().lower()
    if got == "a":
        return verdict(
            False, "ft.steps starts a late rank where its quorum is: it heals instead of redoing"
        )
    if got == "b":
        return verdict(
            False,
            "the survivors did not wait: they went on while the new worker started and ran the "
            "setup cell, so they are further on",
        )
    return verdict(
        got == "c",
        "it heals in its first quorum, copying the model, Adam's state and the step from a live "
        "peer, and trains on from there with the others",
    )


@checker("replace ... with the number of steps computed again")
def steps_redone(answer, every: int, lost_at: int) -> bool:
    """Without torchft: a checkpoint after every ``every`` steps, a rank lost once ``lost_at``
    steps were done; how many steps are computed again after the re-run."""
    expected = lost_at % every
    if answer == 0:
        return verdict(False, "that is torchft; a re-run starts from the latest checkpoint")
    if answer == lost_at:
        return verdict(False, "the re-run loads the latest checkpoint, not step 0")
    return verdict(
        answer == expected,
        f"from the latest checkpoint, step {lost_at - expected}, to step {lost_at}: "
        f"{lost_at} mod {every}",
    )


@checker("replace ... with result2, the training cell's result")
def two_lost_and_back(answer, later: list[dict], steps: int) -> bool:
    """The exercise's outcome: ``answer`` the training cell's ``{rank: {"steps", "weights", ...}}``,
    ``later`` the ``ft.history()`` events after the first table; two ranks lost and back, every
    rank at ``steps`` with the same weights."""
    try:
        reached = {v["steps"] for v in answer.values()}
        weights = {v["weights"] for v in answer.values()}
        came_back = [e["rank"] for e in later if e["event"] == "back"]
    except (AttributeError, KeyError, TypeError):
        return verdict(False, "pass the training cell's result, {rank: {'steps': ..., ...}}")
    if reached != {steps}:
        return verdict(
            False, f"every rank should end at step {steps}; they reached {sorted(reached)}"[:200]
        )
    if len(weights) != 1:
        return verdict(False, "every rank should hold the same weights: did a rank skip its heal?")
    if len(came_back) != 2:
        return verdict(False, f"two ranks should have come back; ft.history() shows {came_back}")
    lost = " and ".join(str(r) for r in came_back)
    return verdict(
        True, f"ranks {lost} lost and back; every rank ended at step {steps} with the same weights"
    )
