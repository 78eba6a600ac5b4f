"""Growing and shrinking the world: ``Controller.scale(n)`` and ``%monarch scale N``.

New workers come from the cluster: the one ``%monarch up`` started gets a nanny per new rank,
planned and pinned as ``up`` plans them (cluster.py); any other cluster object grows through its
own ``scale()`` (a factory's LocalCluster, dask-jobqueue's SLURMCluster). They become the next
ranks, attached as a replaced worker is (attach.py), with fresh namespaces. Ranks leave from the
top, once what they run has ended (calls queued on them, their actors' calls): nothing on them
is cut off mid-way. Either way the ranks that stay keep their namespaces and learn the new
``world_size``, the torch.distributed group forms again over the new world (dist.py), the
sidebar's entry says the new size, and the telemetry of the ranks that left stops showing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monarch_nb import registry
from monarch_nb.controller import attach, capacity, joining, queue_limits, relaunch, setup_cells
from monarch_nb.controller import cluster as clusters
from monarch_nb.controller import mesh as device_mesh
from monarch_nb.controller import sync as code_sync
from monarch_nb.dispatch.results import CellError, Interrupted
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError
from monarch_nb.rank import leaving

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

LOCAL_WAIT = 60  # seconds for the nannies of a local cluster to start their workers
JOBS_WAIT = 600  # any other cluster: jobs may sit in a batch queue (as connect's --wait)
LEAVE_WAIT = 30  # seconds for retired workers to leave the scheduler
CLOSE_WAIT = 3  # seconds for the links of leaving ranks to close (their flush takes up to 2)


@dataclass(frozen=True)
class Scaled:
    """What ``scale`` did: the ranks that joined or left, and the process group after."""

    world_size: int
    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    backend: str | None = None  # the process group formed again over the new world
    dist_error: str | None = None  # why it did not
    mesh: str | None = None  # the device mesh built again over it ("dp=4,tp=2")
    replaced: tuple[int, ...] = ()  # lost ranks whose workers were started again

    def __str__(self) -> str:
        n = self.world_size
        ranks = "1 rank" if n == 1 else f"{n} ranks"
        if not self.joined and not self.left and not self.replaced:
            return f"already {ranks}; nothing changed"
        parts = [f"scaled to {ranks}" if self.joined or self.left else f"still {ranks}"]
        if self.replaced:
            one = len(self.replaced) == 1
            parts.append(
                f"{format_ranks(self.replaced)} lost {'its worker' if one else 'their workers'}"
                f" and got {'a new one' if one else 'new ones'} with "
                + ("an empty namespace" if one else "empty namespaces")
            )
        if self.joined:
            where = f"{self.joined[0]}:{self.joined[-1] + 1}"
            one = len(self.joined) == 1
            parts.append(
                f"{format_ranks(self.joined)} joined with "
                + ("an empty namespace" if one else "empty namespaces")
                + f" (%monarch push NAME --targets {where} fills {'it' if one else 'them'})"
            )
        if self.left:
            one = len(self.left) == 1
            went = "its namespace went with it" if one else "their namespaces went with them"
            parts.append(f"{format_ranks(self.left)} left ({went})")
        if self.backend:
            parts.append(f"the {self.backend} process group was formed again over {ranks}")
        if self.mesh:
            parts.append(f"the device mesh is now {self.mesh}")
        return "; ".join(parts)


def scale(ctl: Controller, n: int, wait: float | None = None) -> Scaled:
    """Make the world ``n`` ranks. ``wait``: seconds for new workers to join (60 for the local
    cluster of ``up``, else 600: batch jobs queue)."""
    ctl._check_open()
    _check(ctl, n)
    shape = device_mesh.rescaled(ctl.mesh_shape, n) if ctl.mesh_shape else None
    before = ctl.world_size
    lost = [info.rank for info in ctl.ranks[:n] if not info.alive]
    if n == before and not lost:
        return Scaled(n, backend=ctl.dist_backend)
    joined: list[int] = []
    left: list[int] = []
    replaced: list[int] = []
    if lost:  # workers gone that nothing replaced: started again under their names
        until = (LOCAL_WAIT if _ours(ctl.cluster) else JOBS_WAIT) if wait is None else wait
        replaced = relaunch.start_again(ctl, lost, until)
    if n > before:
        joined = _grow(ctl, n, wait)
    else:
        left = _shrink(ctl, n)
    # A rank waiting for its replacement gets the new size in its setup (attach.py)
    alive = [info.rank for info in ctl.ranks if info.alive]
    if alive:
        ctl.call(_resize, n, targets=alive)
    if shape is not None:
        ctl.mesh_shape = shape
    ctl._form_group()
    if joined:
        code_sync.resend(ctl, joined)  # what %monarch sync sent the ranks before them
        setup_cells.replay_or_say(ctl, joined)  # then the --setup cells, in their order
    registry.register(ctl)  # the sidebar's count of ranks
    built = device_mesh.text(shape) if shape and not ctl.mesh_error else None
    return Scaled(
        n,
        tuple(joined),
        tuple(left),
        ctl.dist_backend,
        ctl.dist_error or ctl.mesh_error,
        built,
        tuple(replaced),
    )


def _check(ctl: Controller, n: int) -> None:
    """The user's mistakes, each in one line, before anything changes."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"scale takes a whole number of ranks, got {n!r}")
    if n < 1:
        raise ValueError(f"scale needs at least 1 rank, got {n}; %monarch down stops the cluster")
    cluster = ctl.cluster
    if cluster is None:
        raise ClusterError(
            f"this notebook joined the scheduler at {ctl.scheduler_address}, which cannot add "
            "or remove workers; scale the workers where they were started, or connect with "
            "--cluster module:factory to a cluster object that has scale()"
        )
    if not callable(getattr(cluster, "scale", None)):
        raise ClusterError(
            f"the cluster ({type(cluster).__name__}) has no scale(), so it cannot add or remove "
            "workers; have the factory return a distributed cluster object (SLURMCluster, "
            "LocalCluster...)"
        )
    if n > ctl.world_size and not _ours(cluster) and not getattr(cluster, "_supports_scaling", 1):
        raise ClusterError(
            f"the cluster ({type(cluster).__name__}) has no worker template to add workers "
            "from; give it one (SpecCluster's worker=) or scale it where it was made"
        )
    if n > ctl.world_size:
        local = _ours(cluster)
        if local:
            _check_gpus(cluster, n)
        # Before planning: a spec per rank of `scale 99999999999999999999` never ends.
        capacity.check(ctl.world_size, n, local or isinstance(cluster, _local_cluster()))
        queue_limits.check(cluster, n)  # a batch queue's jobs that could never all run
    busy = sorted(ctl._router.busy())
    if busy:
        raise ClusterError(
            f"a %%monarch cell is running on {format_ranks(busy)}; scale once it has ended "
            "(handle.wait() waits for a --noblock one, %monarch interrupt stops it)"
        )


# -- growing ------------------------------------------------------------------------------------
def _grow(ctl: Controller, n: int, wait: float | None) -> list[int]:
    cluster, before = ctl.cluster, ctl.world_size
    specs = set(getattr(cluster, "worker_spec", None) or ())  # the workers there before
    with _StartFailures() as failures:
        try:
            if _ours(cluster):
                _plan_local_workers(cluster, n)
                wait = LOCAL_WAIT if wait is None else wait
            # Started in the background: a wait that runs out or a Ctrl-C scales back cleanly,
            # where one cut short while the nannies start would leave their processes behind.
            cluster.scale(n)
            joined = _wait_for_new(
                ctl, n, JOBS_WAIT if wait is None else wait, failures.reason(cluster, specs)
            )
            # The ranks there keep their RankInfo (their links hold it); the new ones follow.
            there = {
                i.address: {"name": i.name, "host": i.host, "local_directory": i.incarnation}
                for i in ctl.ranks
            }
            new = attach.rank_table({**there, **joined}, previous=ctl.ranks)[before:n]
        except NotImplementedError:
            raise ClusterError(
                f"the cluster ({type(cluster).__name__}) cannot add or remove workers "
                "(its scale() is not implemented)"
            ) from None
        except KeyboardInterrupt:
            _scale_back(cluster, before, specs)
            raise Interrupted(
                f"interrupted while new workers joined; the cluster was scaled back to {before}"
            ) from None
        except BaseException:
            _scale_back(cluster, before, specs)
            raise
        ctl.ranks = ctl.ranks + new
        try:
            attach.open_links(ctl, new)
        except BaseException:
            _detach(ctl, [info.rank for info in new], before)
            _scale_back(cluster, before, specs)
            raise
    return [info.rank for info in new]


class _StartFailures(logging.Filter):
    """What Dask logs while new workers start, kept here instead of reaching the cell: a nanny
    whose worker failed to start, the cluster's task that started them (tornado's "Exception
    in callback"), an event loop out of descriptors (asyncio's, once per turn of the loop:
    megabytes in the cell when ``scale 10000`` ran the kernel out of them). The first one's
    cause is the failed grow's reason."""

    LOGGERS = ("distributed.nanny", "distributed.deploy.spec", "tornado.application", "asyncio")

    def __init__(self):
        super().__init__()
        self.first: BaseException | None = None  # the first error's exception
        self.said: str | None = None  # or its message, where it had none ("Worker failed...")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and self.first is None:
            self.first = exc
        if self.said is None:
            self.said = record.getMessage()
        return False

    def __enter__(self) -> _StartFailures:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def reason(self, cluster, specs: set):
        """For the wait: why the new workers cannot all join (one of them failed to start, or
        the task starting them did), else None."""

        def failed() -> str | None:
            workers = dict(getattr(cluster, "workers", None) or {})
            dead = [
                w
                for name, w in workers.items()
                if name not in specs and getattr(getattr(w, "status", None), "name", "") == "failed"
            ]
            if not dead and self.first is None:
                return None
            # A nanny keeps why it failed (Dask's private name for it); the log has it too,
            # but only once every new nanny has started or failed.
            kept = next((getattr(w, "_Server__startup_exc", None) for w in dead), None)
            cause = _root(kept or self.first) if kept or self.first else None
            why = f"{type(cause).__name__}: {cause}" if cause is not None else self.said
            who = "a new worker" if len(dead) <= 1 else f"{len(dead)} new workers"
            return f"{who} failed to start ({why or 'its nanny gave no reason'})"

        return failed


def _root(exc: BaseException) -> BaseException:
    """The first cause of ``exc`` (Dask wraps it: "LocalNanny failed to start.")."""
    seen = {id(exc)}
    while (cause := exc.__cause__ or exc.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        exc = cause
    return exc


def _ours(cluster) -> bool:
    """The local cluster that ``up`` started: its specs are our nannies."""
    specs = getattr(cluster, "worker_spec", None) or {}
    return bool(specs) and all(s.get("cls") is clusters._nanny_class() for s in specs.values())


def _plan_local_workers(cluster, n: int) -> None:
    """The spec of a nanny per new rank, each planned as ``up`` planned the first (CPU or
    pinned to its GPU, as many threads; more ranks than visible GPUs were refused before,
    ``_check_gpus``). ``scale(n)`` then starts them (our specs have no template to grow from)."""
    specs = cluster.worker_spec
    first = next(iter(specs.values()))
    options = first["options"]
    inventory, on_gpus = _gpus(cluster)
    plans = clusters.plan_workers(
        inventory, workers=n, cpu=not on_gpus, threads=options.get("nthreads", 1)
    )
    for plan in plans:
        if plan.name not in specs:
            specs[plan.name] = {
                "cls": first["cls"],
                "options": {**options, "name": plan.name, "env": plan.env},
            }


def _gpus(cluster) -> tuple[clusters.GpuInventory, bool]:
    """The GPUs visible here, and whether the ranks of ``up``'s cluster run on them."""
    options = next(iter(cluster.worker_spec.values()))["options"]
    inventory = clusters.detect_gpus()
    return inventory, bool(inventory.variable and options["env"].get(inventory.variable))


def _check_gpus(cluster, n: int) -> None:
    """More GPU ranks than visible GPUs is refused, as ``up`` refuses it."""
    inventory, on_gpus = _gpus(cluster)
    visible = len(inventory.ids)
    if on_gpus and n > visible:
        are = "is" if visible == 1 else "are"
        raise ValueError(
            f"{n} ranks need {n} GPUs, one each, but {visible} {are} visible; scale to "
            f"{visible} at most (or start CPU ranks with %monarch up --cpu)"
        )


def _local_cluster():
    from distributed import LocalCluster

    return LocalCluster


def _wait_for_new(ctl: Controller, n: int, wait: float, failed) -> dict[str, dict]:
    """The new workers (address -> info), once there are ``n`` minus the ranks there."""
    there = len(ctl.ranks)
    return joining.wait_for_workers(
        ctl.client,
        n - there,
        wait,
        ctl.cluster,
        there=ctl.ranks,
        new="new ",
        longer=f"; the cluster was scaled back to {there} (wait=S waits longer)",
        stop="interrupt to stop: the cluster is scaled back",
        failed=failed,
        after=f"; the cluster was scaled back to {there}",
    )


def _scale_back(cluster, n: int, specs: set) -> None:
    """Undo a grow that did not finish, and wait (bounded) until it is undone: a SpecCluster
    drops exactly the specs the grow added and closes their workers, started or not; any
    other cluster is scaled to ``n``."""
    from distributed import SpecCluster

    try:
        if isinstance(cluster, SpecCluster):
            added = [name for name in cluster.worker_spec if name not in specs]
            cluster.sync(cluster.scale_down, added, callback_timeout=LEAVE_WAIT)
        else:
            cluster.scale(n)
    except Exception as e:
        print(f"monarch-nb: could not scale the cluster back to {n}: {e}", file=sys.stderr)


# -- shrinking ----------------------------------------------------------------------------------
def _shrink(ctl: Controller, n: int) -> list[int]:
    leaving = ctl.ranks[n:]
    ranks = [info.rank for info in leaving]
    # Behind whatever the leaving ranks still run or have queued, on their own threads (a rank
    # whose worker is gone has nothing left to run); Ctrl-C here stops waiting, with nothing
    # changed.
    try:
        _wait_for_replies(ctl, leaving)
        alive = [info.rank for info in leaving if info.alive]
        if alive:
            ctl.call(_finish_work, targets=alive)
    except (CellError, KeyboardInterrupt) as e:
        why = getattr(e, "headline", "interrupted")
        if why.startswith("interrupted"):
            raise Interrupted(
                f"stopped waiting for the work of {format_ranks(ranks)} to end; nothing was scaled"
            ) from None
        raise ClusterError(f"{format_ranks(ranks)} could not get ready to leave: {e}") from None
    _detach(ctl, ranks, n)
    _retire(ctl, leaving)
    ctl.metrics.retire(ranks)
    return ranks


def _wait_for_replies(ctl: Controller, leaving) -> None:
    """The actor calls this notebook made to the leaving ranks get their replies first: one
    sent a moment ago may not have reached its rank yet, where ``_finish_work`` looks."""
    addresses = {info.address for info in leaving}
    start, told = time.monotonic(), False
    while owed := sum(hook(ctl, addresses) for hook in list(ctl.owing_hooks.values())):
        if not told and time.monotonic() - start > 1:
            calls = "1 actor call" if owed == 1 else f"{owed} actor calls"
            print(
                f"monarch-nb: waiting for {calls} on "
                f"{format_ranks(info.rank for info in leaving)} to end (interrupt to stop "
                "waiting: nothing is scaled then)",
                file=sys.stderr,
            )
            told = True
        time.sleep(0.05)


def _detach(ctl: Controller, ranks: list[int], n: int) -> None:
    """Close the links of ``ranks`` as the controller's own doing (no replacement is waited
    for) and keep the first ``n`` ranks."""
    links = [ctl._links.pop(rank) for rank in ranks if rank in ctl._links]
    # The table first, and the requests waiting on these ranks finished here: a close that
    # does not end in time (an event loop too busy) used to leave ranks without links, and
    # every later command failed with KeyError.
    ctl.ranks = ctl.ranks[:n]
    for rank in ranks:
        ctl._known.pop(rank, None)
        ctl.unanswering.discard(rank)
    for link in links:
        link.closing = True
        link.gone("it left with %monarch scale")

    async def close_all():
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    with contextlib.suppress(TimeoutError):  # their connections close when the loop gets to it
        ctl._on_loop(close_all(), timeout=CLOSE_WAIT)


def _retire(ctl: Controller, leaving) -> None:
    """Stop exactly the workers of ``leaving``: a SpecCluster drops their specs (it would
    otherwise drop the ones it added last); any other cluster retires them through the
    scheduler and is told its new size."""
    from distributed import SpecCluster

    cluster = ctl.cluster
    addresses = {info.address for info in leaving}
    if isinstance(cluster, SpecCluster):
        try:
            names = [info.name for info in leaving]
            cluster.sync(cluster.scale_down, names, callback_timeout=LEAVE_WAIT)
        except TimeoutError:
            raise ClusterError(
                f"the workers of {format_ranks(info.rank for info in leaving)} did not stop "
                f"within {LEAVE_WAIT} s; they are no longer ranks"
            ) from None
    else:
        ctl.client.retire_workers(workers=sorted(addresses), close_workers=True)
        cluster.scale(ctl.world_size)
    deadline = time.monotonic() + LEAVE_WAIT
    while addresses & set(clusters.workers(ctl.client)):
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the workers of {format_ranks(info.rank for info in leaving)} did not leave "
                f"within {LEAVE_WAIT} s; they are no longer ranks"
            )
        time.sleep(0.05)


# -- on the ranks -------------------------------------------------------------------------------
def _finish_work(engine) -> None:
    """On a leaving rank's thread, after what was queued before: wait for its actors' calls."""
    leaving.wait_for_work(
        told=lambda name: print(
            f"waiting for the running calls of actor {name!r} to end before leaving "
            "(interrupt to stop waiting: nothing is scaled then)",
            flush=True,
        )
    )


def _resize(engine, world_size: int) -> None:
    """On every rank: the new ``world_size``, for its cells and for the group's forming."""
    engine.identity["world_size"] = world_size
    engine.namespace["world_size"] = world_size
