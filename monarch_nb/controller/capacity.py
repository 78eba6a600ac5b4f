"""How many ranks a ``%monarch scale`` may add, or ``%monarch up`` start, before anything
starts: the ranks of a local cluster need memory and processes on this machine, and every rank
needs open files in this kernel (its links; a local cluster's nannies and scheduler live here
too). A size past any of them is refused in one line that gives the estimate. ``scale 10000``
used to start a nanny per rank until the kernel ran out of descriptors; its event loop then
logged the same traceback on every turn, for minutes, into the cell, and the ranks there
stopped answering."""

from __future__ import annotations

import os
import resource

import psutil

MiB = 2**20
# A CPU rank's own memory. A worker forked from the forkserver measured 203 MiB of RSS after a
# cell of torch matmuls and an all_reduce, but 180 MiB of that is the forkserver's imports,
# shared (the frozen gc keeps them so: rank/preload.py); its own pages (USS) were 23 MiB and
# its keeper's 4 (psutil's memory_full_info, 2 to 8 ranks on the 2-core dev VM, commit
# e14aff4). Rounded up: a new rank costs the machine this, not its RSS.
RANK_MEMORY = 32 * MiB
# Processes and threads per rank (RLIMIT_NPROC counts threads): the worker's 13 and its
# keeper, and the 3 threads its nanny adds to the kernel (same measurement).
RANK_TASKS = 17
# Descriptors per rank in this kernel: for a local cluster, the nanny's, the in-process
# scheduler's side of the worker's connections and the controller's links: 14, counted in
# /proc/self/fd before and after scaling 2 ranks to 3; for another cluster, the links (2) and
# the scheduler's side where it runs here, as dask-jobqueue's does (4).
LOCAL_RANK_FILES = 14
REMOTE_RANK_FILES = 6


def check(
    before: int,
    n: int,
    local: bool,
    up: bool = False,
    mesh: str | None = None,
    asked: str | None = None,
) -> None:
    """Refuse growing from ``before`` to ``n`` ranks (ValueError, one line) where the new ranks
    would not fit: memory and processes on this machine for a ``local`` cluster's ranks, and,
    for any cluster, open files in this kernel. The tightest limit is the one named. ``up``:
    said of ``up --workers n`` rather than ``scale n``, or of ``up --mesh MESH`` where the
    mesh asked for ``n`` (``mesh="dp=64"``); ``asked``: said of that instead (``spawn_procs(...)``
    of actors/hosts.py), with the room left in processes."""
    new = n - before
    if new <= 0:
        return
    limits = [_files(new, LOCAL_RANK_FILES if local else REMOTE_RANK_FILES)]
    if local:
        limits += [_memory(new), _tasks(new)]
    most, why = min((limit for limit in limits if limit is not None), default=(new, ""))
    if new <= most:
        return
    if asked:
        fit = f"{before + most} processes at most" if most > 0 else "no more processes fit"
    elif up and mesh:
        asked = f"up --mesh {mesh} ({n} ranks)"
        fit = f"a mesh of {most} ranks at most" if most > 0 else "no rank fits"
    elif up:
        asked = f"up --workers {n}"
        fit = f"--workers {most} at most" if most > 0 else "no rank fits"
    else:
        asked = f"scale {n}"
        fit = (
            f"scale to {before + most} at most"
            if most > 0
            else f"no more ranks fit: the cluster stays at {before}"
        )
    raise ValueError(f"{asked} is more than this machine can hold: {why}; {fit}")


def _memory(new: int) -> tuple[int, str]:
    available = psutil.virtual_memory().available
    return available // RANK_MEMORY, (
        f"{new} new ranks need about {_size(new * RANK_MEMORY)} of memory "
        f"({_size(RANK_MEMORY)} each), and {_size(available)} is available"
    )


def _tasks(new: int) -> tuple[int, str] | None:
    """Free processes: the system's (pid_max, threads-max) and, unless root, this user's
    RLIMIT_NPROC (``ulimit -u``), which counts threads."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[1])  # every thread on the system
        ceilings = []
        for name in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
            with open(name) as f:
                ceilings.append(int(f.read()))
    except (OSError, ValueError, IndexError):
        return None  # not Linux: no cheap count
    free, where = min(ceilings) - running, "the system"
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.getuid() != 0 and soft != resource.RLIM_INFINITY:  # root is not held to it
        uid = os.getuid()
        mine = sum(
            p.info["num_threads"] or 0
            for p in psutil.process_iter(["uids", "num_threads"])
            if p.info["uids"] is not None and p.info["uids"].real == uid
        )
        if soft - mine < free:
            free, where = soft - mine, f"this user (ulimit -u {soft})"
    free = max(free, 0)
    return free // RANK_TASKS, (
        f"{new} new ranks need about {new * RANK_TASKS} processes and threads "
        f"({RANK_TASKS} each), and {where} may start {free} more"
    )


def _files(new: int, each: int) -> tuple[int, str] | None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    free = max(soft - used, 0)
    return free // each, (
        f"{new} new ranks need about {new * each} open files in this kernel ({each} each), "
        f"and {free} of its {soft} (ulimit -n) are free"
    )


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}" if n < 2**20 * scale else f"{n / scale:.3g} {unit}"
    return f"{n / MiB:.0f} MiB"
