"""Exercises of notebooks/06-scaling-out.ipynb: how many ranks a cluster has, which of them are
new after ``%monarch scale``, what a collective gives at the new size, and what ``%monarch down``
leaves running."""

from __future__ import annotations

from monarch_nb.examples.exercises import checker, close, verdict


@checker("replace ... with the number of ranks")
def ranks_from_jobs(answer, jobs: int, processes: int, cores: int) -> bool:
    """``make_cluster`` with ``scale(jobs=jobs)``, ``processes`` workers per job of ``cores``
    cores each: how many ranks."""
    expected = jobs * processes
    if answer == jobs * cores and cores != processes:
        return verdict(False, "cores are what a job may use; a rank is a worker process")
    if answer == jobs * processes * cores and cores != 1:
        return verdict(False, "cores per job do not add workers: each worker is one rank")
    return verdict(
        answer == expected,
        f"one rank per worker, {processes} worker(s) per job: {jobs} × {processes}",
    )


def _scaled(start: int, sizes: list[int]) -> set[int]:
    """The ranks with empty namespaces after scaling from ``start`` ranks through ``sizes``."""
    alive, fresh = set(range(start)), set()
    for size in sizes:
        for rank in sorted(alive, reverse=True)[: max(len(alive) - size, 0)]:
            alive.discard(rank)
            fresh.discard(rank)  # a rank that leaves takes its namespace with it
        for rank in range(len(alive), size):
            alive.add(rank)
            fresh.add(rank)
    return fresh


@checker("replace ... with a set of ranks, e.g. {2}")
def fresh_ranks(answer, start: int, sizes: list[int]) -> bool:
    """From ``start`` ranks, ``%monarch scale`` to each of ``sizes`` in turn: which ranks then
    have an empty namespace (joined as new workers)."""
    expected = _scaled(start, sizes)
    try:
        got = {int(r) for r in answer}
    except (TypeError, ValueError):
        return verdict(False, "answer with a set of rank numbers, e.g. {0, 1}")
    if got == expected:
        return verdict(
            True,
            "ranks leave from the top, and a rank that joins is a new worker whatever its number",
        )
    if got < expected:
        return verdict(
            False,
            "a rank that left and came back under the same number is a new worker: its "
            "namespace is empty too",
        )
    return verdict(False, "the ranks that never left keep their namespaces")


@checker("replace ... with the number every rank prints")
def all_reduce_after_scale(answer, world: int) -> bool:
    """After ``%monarch scale world``: ``dist.all_reduce`` of ``rank + 1`` gives what."""
    expected = world * (world + 1) / 2
    if close(answer, world):
        return verdict(False, "each rank adds rank + 1, not 1: 1 + 2 + ... + world")
    if close(answer, 3.0) and world != 2:
        return verdict(
            False, "that is the sum at 2 ranks; the process group forms again at the new size"
        )
    return verdict(
        close(answer, expected), f"the sum of rank + 1 over {world} ranks: {world}·({world}+1)/2"
    )


@checker("replace ... with the number of dask worker processes")
def workers_to_start(answer, nodes: int, gpus_per_node: int) -> bool:
    """How many ``dask worker`` commands a cluster of ``nodes`` nodes of ``gpus_per_node`` GPUs
    needs (one rank per GPU)."""
    expected = nodes * gpus_per_node
    if answer == nodes:
        return verdict(False, "one worker per GPU, not per node: each worker is a rank on one GPU")
    if answer == expected + 1:
        return verdict(False, "the scheduler is not a dask worker: it runs once, on the head node")
    return verdict(
        answer == expected, f"one worker (and one rank) per GPU: {nodes} × {gpus_per_node}"
    )


@checker("replace ... with how many of the processes still run")
def still_running(answer, workers: int) -> bool:
    """After ``%monarch down`` on a cluster joined with ``%monarch connect``: how many of its
    scheduler and ``workers`` workers still run."""
    expected = workers + 1
    if answer == 0:
        return verdict(
            False, "%monarch down stops only what the notebook started; it joined this cluster"
        )
    if answer == workers:
        return verdict(False, "the scheduler runs on too: nothing stopped it")
    return verdict(
        answer == expected,
        f"down only disconnects from a cluster it did not start: scheduler and {workers} workers",
    )
