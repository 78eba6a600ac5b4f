"""The CPU time a cluster's processes use: per trivial cell, and while idle (bench_breakdown.py)."""

from __future__ import annotations

import contextlib
import os
import time


def worker_pids(ctl) -> dict[int, int]:
    """rank -> the pid of its worker process."""
    return ctl.call(lambda engine: os.getpid()).to_dict()


# -- idle -----------------------------------------------------------------------------------------
def idle_cpu(ctl, seconds: float) -> dict:
    import psutil

    pids = worker_pids(ctl)
    me = psutil.Process()
    procs = []
    for pid in pids.values():
        p = psutil.Process(pid)
        procs.append(("worker", p))
        # a local cluster's nannies live in this process (counted with it), a remote one's
        # in a process of its own
        with contextlib.suppress(psutil.Error):
            parent = p.parent()
            if parent is not None and parent.pid != me.pid:
                procs.append(("nanny", parent))

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    before = {id(p): cpu(p) for _, p in procs}
    mine = cpu(me)
    time.sleep(seconds)
    used = {"worker": 0.0, "nanny": 0.0}
    for kind, p in procs:
        used[kind] += cpu(p) - before[id(p)]
    n = len(pids)
    return {
        "worker %": 100 * used["worker"] / seconds / n,
        "nanny process %": 100 * used["nanny"] / seconds / n,
        "per worker %": 100 * (used["worker"] + used["nanny"]) / seconds / n,
        "notebook process (scheduler, nannies, client) %": 100 * (cpu(me) - mine) / seconds,
    }


# -- CPU per cell -------------------------------------------------------------------------------
def cpu_per_cell(ctl, cells: int, warmup: int) -> dict[str, tuple[float, float]]:
    """CPU time (user, system; ms) per trivial cell of this process (the controller, with the
    scheduler and the nannies of a local cluster) and of each worker process, over ``cells``
    round trips; the kernel counts CPU time in ticks (10 ms), so ``cells`` should take seconds."""
    import psutil

    procs = {"controller process": psutil.Process()}
    for rank, pid in sorted(worker_pids(ctl).items()):
        procs[f"rank {rank}'s worker process"] = psutil.Process(pid)
    for _ in range(warmup):
        ctl.run("x = 1")
    before = {k: p.cpu_times() for k, p in procs.items()}
    for _ in range(cells):
        ctl.run("x = 1")
    out = {}
    for k, p in procs.items():
        t = p.cpu_times()
        out[k] = (
            1e3 * (t.user - before[k].user) / cells,
            1e3 * (t.system - before[k].system) / cells,
        )
    return out
