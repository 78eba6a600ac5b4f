"""Making or joining a cluster.

A local cluster has one worker process per visible GPU, each pinned to exactly its GPU so that
``cuda:0`` inside the worker is that GPU; with no GPU it has CPU workers. Every ROCm/CUDA
difference in pinning lives here: the variable that pins (``HIP_VISIBLE_DEVICES`` on ROCm,
``CUDA_VISIBLE_DEVICES`` on NVIDIA, or whichever one the user already narrowed) and how GPUs are
counted (``/sys/class/kfd`` on ROCm, ``/proc/driver/nvidia`` on NVIDIA), both read without
importing torch so that start-up stays quick.

The local workers are not daemon processes, so that code on a rank may start processes of its
own (a DataLoader with ``num_workers``, a multiprocessing Pool); the cluster is closed at exit
before multiprocessing waits for its non-daemon children.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
import signal
import subprocess
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from monarch_nb.controller import forkserver, lazy_dashboard, main_module

DEFAULT_CPU_WORKERS = 2


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs this process may use: ``vendor`` is ``"rocm"``, ``"cuda"`` or ``None``;
    ``ids`` are the values to put in the pinning variable, one per GPU."""

    vendor: str | None
    ids: tuple[str, ...] = ()
    variable: str | None = None


@dataclass(frozen=True)
class WorkerPlan:
    name: int
    env: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None


def _visible(env: Mapping[str, str], name: str) -> list[str] | None:
    value = env.get(name)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _count_rocm(root: Path) -> int:
    # Each KFD topology node is an agent; GPUs have a non-zero simd_count, CPUs have zero.
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    count = 0
    for props in sorted(nodes.glob("*/properties")):
        for line in props.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "simd_count" and value.strip() not in ("", "0"):
                count += 1
    return count


def _count_nvidia(root: Path) -> int:
    return len(list((root / "proc/driver/nvidia/gpus").glob("*")))


def detect_gpus(env: Mapping[str, str] | None = None, root: str | Path = "/") -> GpuInventory:
    """The GPUs visible to this process, honouring any visibility variable already set."""
    env = os.environ if env is None else env
    root = Path(root)
    rocm, nvidia = _count_rocm(root), _count_nvidia(root)
    if rocm:
        # HIP honours CUDA_VISIBLE_DEVICES as well; pin with whichever the user narrowed.
        for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            ids = _visible(env, var)
            if ids is not None:
                return GpuInventory("rocm", tuple(ids), var)
        rocr = _visible(env, "ROCR_VISIBLE_DEVICES")
        n = len(rocr) if rocr is not None else rocm
        return GpuInventory("rocm", tuple(str(i) for i in range(n)), "HIP_VISIBLE_DEVICES")
    if nvidia:
        ids = _visible(env, "CUDA_VISIBLE_DEVICES")
        if ids is None:
            ids = [str(i) for i in range(nvidia)]
        return GpuInventory("cuda", tuple(ids), "CUDA_VISIBLE_DEVICES")
    return GpuInventory(None)


def plan_workers(
    inventory: GpuInventory,
    workers: int | None = None,
    cpu: bool = False,
    threads: int = 1,
    mesh: str | None = None,
) -> list[WorkerPlan]:
    """One plan per worker process: its rank (= worker name) and the environment it starts with.
    ``mesh``: the ``--mesh`` that asked for ``workers``, named where they cannot be."""
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    base = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if cpu or not inventory.ids:
        n = workers or DEFAULT_CPU_WORKERS
        env = dict(base)
        if inventory.variable:
            env[inventory.variable] = ""  # hide the GPUs from CPU workers
        return [WorkerPlan(i, dict(env)) for i in range(n)]
    n = workers or len(inventory.ids)
    if n > len(inventory.ids) and mesh:
        raise ValueError(
            f"--mesh {mesh} asks for {n} workers but {len(inventory.ids)} GPUs are visible; "
            f"give a mesh of {len(inventory.ids)} ranks at most, or add --cpu for CPU workers"
        )
    if n > len(inventory.ids):
        raise ValueError(
            f"asked for {n} workers but {len(inventory.ids)} GPUs are visible; "
            f"use --workers {len(inventory.ids)} or add --cpu for CPU workers"
        )
    return [
        WorkerPlan(i, {**base, inventory.variable: gpu}, gpu)
        for i, gpu in enumerate(inventory.ids[:n])
    ]


_DAEMON_KEY = "distributed.worker.daemon"
_daemon_lock = threading.Lock()
_daemon_depth = 0
_daemon_saved = True
_method_saved = "spawn"


@contextlib.contextmanager
def _workers_not_daemons():
    """``distributed.worker.daemon: False`` while one of our nannies starts its worker process
    (Dask reads it then, in this process). The nannies start at once on the event loop, so
    nested ``dask.config.set`` blocks would restore each other's value: the first one in saves
    the user's value and the last one out puts it back. Forked from the forkserver where
    that is on (forkserver.py), as start, restart and replacement alike."""
    import dask

    global _daemon_depth, _daemon_saved, _method_saved
    with _daemon_lock:
        if _daemon_depth == 0:
            _daemon_saved = dask.config.get(_DAEMON_KEY, default=True)
            _method_saved = dask.config.get(forkserver.METHOD_KEY, default="spawn")
            method = "forkserver" if forkserver.enabled() else _method_saved
            dask.config.set({_DAEMON_KEY: False, forkserver.METHOD_KEY: method})
        _daemon_depth += 1
    try:
        yield
    finally:
        with _daemon_lock:
            _daemon_depth -= 1
            if _daemon_depth == 0:
                dask.config.set({_DAEMON_KEY: _daemon_saved, forkserver.METHOD_KEY: _method_saved})


@functools.cache
def _nanny_class():
    from distributed import Nanny

    class LocalNanny(Nanny):
        """A nanny whose worker process is not a daemon: at start, restart and replacement."""

        async def instantiate(self):
            with _workers_not_daemons():
                return await super().instantiate()

        async def _on_worker_exit(self, exitcode):
            # Its "Restarting worker" warning would reach the cell that runs when a worker
            # dies; the controller says so itself (WorkerLost, then the replacement's notice).
            _replacing.set(True)
            return await super()._on_worker_exit(exitcode)

    return LocalNanny


_replacing: contextvars.ContextVar[bool] = contextvars.ContextVar("replacing", default=False)


def _not_replacing(record: logging.LogRecord) -> bool:
    """The nanny logging filter: drops its warning as it replaces a worker of ours."""
    return not (_replacing.get() and str(record.msg).startswith("Restarting worker"))


_local_clusters: weakref.WeakSet = weakref.WeakSet()
_exit_finalizer = None


def _close_local_clusters() -> None:
    for cluster in list(_local_clusters):
        if cluster.status.name not in ("closing", "closed"):
            with contextlib.suppress(Exception):
                cluster.close(timeout=10)


def _close_at_exit(cluster) -> None:
    """Close ``cluster`` when the interpreter exits normally, before multiprocessing joins its
    non-daemon children (it would wait forever for workers still running). A multiprocessing
    finalizer runs first in its exit handler, wherever that handler stands among the others."""
    from multiprocessing import util

    global _exit_finalizer
    if _exit_finalizer is None:
        _exit_finalizer = util.Finalize(None, _close_local_clusters, exitpriority=10)
    _local_clusters.add(cluster)


# Dask's defaults suit workers that run tasks under a dashboard; a rank mostly waits between
# cells, and these were most of an idle worker's CPU (4.4% of a core, benchmarks/
# bench_breakdown.py): the statistical profiler sampling every thread's stack every 10 ms (for
# the dashboard's profile page; a cell's thread waits for the GIL meanwhile), the event loop's
# health check every 20 ms, the memory and system monitors every 100 and 500 ms.
WORKER_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "2s",
    "distributed.admin.system-monitor.interval": "2s",
}
# s between a local worker's heartbeats (Dask's scheduler asks 0.5 s of up to 10 workers): each
# sends its metrics and the scheduler answers; a lost worker is noticed by its nanny and its
# closed connections, not by missing heartbeats.
HEARTBEAT = 1.0


def _scheduler_class():
    from distributed import Scheduler

    class LocalScheduler(Scheduler):
        def __init__(self, *args, **kwargs):
            # Dask's Bokeh dashboard is made when first asked for (lazy_dashboard.py)
            super().__init__(*args, dashboard=False, **kwargs)
            lazy_dashboard.install(self)

        def heartbeat_worker(self, **kwargs):
            reply = super().heartbeat_worker(**kwargs)
            if "heartbeat-interval" in reply:
                reply["heartbeat-interval"] = max(reply["heartbeat-interval"], HEARTBEAT)
            return reply

    return LocalScheduler


def _worker_config() -> dict:
    """This process's Dask config with WORKER_CONFIG, for the nannies to give their workers."""
    import copy

    import dask

    with dask.config.set(WORKER_CONFIG):
        return copy.deepcopy(dask.config.config)


def start_local(plans: list[WorkerPlan], threads: int = 1, security=None):
    """A SpecCluster with its scheduler in this process and one nanny per plan, on 127.0.0.1.

    With a ``distributed.Security`` every comm (scheduler, nannies, workers, the client) speaks
    TLS with its certificates; the dashboard stays plain HTTP, still on 127.0.0.1 only.
    """
    import dask

    # Already started by up's thread, before Dask was imported: started afresh here only where
    # the user's Dask configuration changes the variables it started with.
    forkserver.start()
    main_module.install()  # its workers leave a script's top-level code alone (main_module.py)
    from distributed import SpecCluster

    forkserver.keep_preload()
    from monarch_nb.controller import handshake

    handshake.bound_dask_handshakes()  # what its listener reads before a handshake
    _quiet_dask_logs()
    protocol = "tls" if security is not None else "tcp"
    tls = {"security": security} if security is not None else {}
    config = _worker_config()
    scheduler = {
        "cls": _scheduler_class(),
        "options": {
            "host": "127.0.0.1",
            "port": 0,
            "protocol": protocol,
            "dashboard_address": "127.0.0.1:0",
            **tls,
        },
    }
    workers = {
        plan.name: {
            "cls": _nanny_class(),
            "options": {
                "name": plan.name,
                "nthreads": threads,
                "host": "127.0.0.1",
                "protocol": protocol,
                "env": plan.env,
                "dashboard": False,
                "silence_logs": logging.WARNING,
                "config": config,
                **tls,
            },
        }
        for plan in plans
    }
    # The scheduler and the nannies in this process check their event loops' health each
    # second too (read as they are made); the nannies' memory monitor keeps Dask's 100 ms: it
    # is what stops a rank that runs away with the machine's memory.
    tick = "distributed.admin.tick.interval"
    with dask.config.set({tick: WORKER_CONFIG[tick]}):
        cluster = SpecCluster(
            workers=workers,
            scheduler=scheduler,
            silence_logs=logging.WARNING,
            name="monarch-nb",
            **tls,
        )
    _close_at_exit(cluster)
    return cluster


def _quiet_dask_logs() -> None:
    """Keep the in-process scheduler's and nannies' INFO lines out of the notebook.
    ``silence_logs`` quiets the handler Dask puts on its "distributed" logger; where logging
    was configured first (``logging.basicConfig`` in the notebook), Dask puts none there and
    its INFO lines reach the root's handler, so the logger itself is set to WARNING."""
    logger = logging.getLogger("distributed")
    own = any(isinstance(h, logging.StreamHandler) for h in logger.handlers)
    if not own and logger.getEffectiveLevel() < logging.WARNING:
        logger.setLevel(logging.WARNING)
    nanny = logging.getLogger("distributed.nanny")
    if _not_replacing not in nanny.filters:
        nanny.addFilter(_not_replacing)


def workers(client) -> dict[str, dict]:
    """Every worker the scheduler knows now (address -> its info), asked for this call.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: that returns the client's cached
    identity, which its periodic refresh (every 2 s, with no workers) may have replaced
    between the fresh fetch and the return; a wait saw "0 of 3 workers" that way."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def scheduler_gone(client, cluster) -> bool:
    """Whether the cluster's scheduler went before the notebook let go of it (the sidebar's
    "Shut down", ``scheduler.close()``, a killed scheduler): the client is reconnecting or
    an in-process scheduler has closed."""
    if getattr(client, "status", "running") != "running":
        return True
    scheduler = getattr(cluster, "scheduler", None)
    status = getattr(getattr(scheduler, "status", None), "name", "running")
    return status in ("closing", "closed", "failed")


@contextlib.contextmanager
def _quiet(gone: bool, nanny: bool = False):
    """Dask's lines that say what down asked for or what was said already: where the
    scheduler is gone, each failure to reach it, with tracebacks; with ``nanny``, the nanny's
    warning that it killed a worker still busy after 4 s (a running cell, a loaded machine)."""
    if gone:
        names = ["distributed"] + [
            name for name in logging.Logger.manager.loggerDict if name.startswith("distributed.")
        ]
    else:
        names = ["distributed.nanny"] if nanny else []
    levels = {name: logging.getLogger(name).level for name in names}  # some have their own
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL if gone else logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def close_client(client, gone: bool) -> None:
    with _quiet(gone):
        client.close()


def close_cluster(cluster, gone: bool) -> None:
    """Close a cluster; quickly when its scheduler is ``gone``. Dask would try to reach the
    scheduler for 30 s to shut it down, and each nanny waits 4 s for its worker, which tries
    to reach it too, before killing it: the nannies' workers here are killed at once (they
    can do nothing without a scheduler; each keeper then ends what they started)."""
    with _quiet(gone, nanny=True):
        if gone:
            if hasattr(cluster, "shutdown_scheduler"):
                cluster.shutdown_scheduler = False
            for nanny in list(getattr(cluster, "workers", {}).values()):
                pid = getattr(
                    getattr(getattr(nanny, "process", None), "process", None), "pid", None
                )
                if pid:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        cluster.close()
    release_forkserver()


def release_forkserver() -> None:
    """A local cluster closed (or never started): let go of the forkserver (forkserver.py),
    which ends once the last worker forked from it has."""
    forkserver.stop()


def load_factory(spec: str):
    """``module:factory`` -> the cluster object the factory returns (dask-jobqueue,
    KubeCluster, …)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--cluster takes module:factory (for example mysite:make_cluster), got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--cluster {spec}: cannot import {module_name!r}: {e}") from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--cluster {spec}: {module_name} has no attribute {attr!r}") from None
    try:
        cluster = factory() if callable(factory) else factory
    except Exception as e:
        raise ValueError(f"--cluster {spec}: the factory raised {type(e).__name__}: {e}") from None
    if not hasattr(cluster, "scheduler_address"):
        raise ValueError(
            f"--cluster {spec} returned {type(cluster).__name__}, not a distributed cluster "
            "(it needs a scheduler_address)"
        )
    return cluster


def jobs_not_joined(cluster, joined: set) -> str:
    """The batch jobs of a dask-jobqueue ``cluster`` whose workers are not among ``joined``
    (worker names), each with its Slurm state (``job 17 PENDING (PartitionDown)``); "" for
    any other cluster. A Slurm that does not answer leaves just the job ids."""
    jobs = [
        str(job.job_id)
        for name, job in (getattr(cluster, "workers", None) or {}).items()
        if name not in joined and getattr(job, "job_id", None)
    ]
    if not jobs:
        return ""
    if getattr(getattr(cluster, "job_cls", None), "submit_command", None) != "sbatch":
        return "batch " + ", ".join(f"job {job}" for job in jobs)
    states: dict[str, str] = {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T %r"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "Slurm " + ", ".join(f"job {job}" for job in jobs)
    for line in out.stdout.splitlines():
        job, _, state = line.partition(" ")
        state, _, reason = state.partition(" ")
        states[job] = f"{state} ({reason})" if reason not in ("", "None") else state
    # squeue answers "Invalid job id" when none of them is queued any more
    if out.returncode == 0 or "Invalid job id" in out.stderr:
        gone = "no longer queued (its log says why)"
        return "Slurm " + ", ".join(f"job {job} {states.get(job, gone)}" for job in jobs)
    return "Slurm " + ", ".join(f"job {job}" for job in jobs)
