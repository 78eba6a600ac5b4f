"""torch.distributed over Dask.

Rank 0 opens a TCPStore on a port the OS picks (so two clusters on one machine never collide and
no MASTER_PORT is left in any environment); every rank then joins the default process group
through that store, each in its own engine thread, at the same time. On GPU workers
``cpu:gloo,cuda:nccl`` (RCCL on ROCm builds of torch), as ``init_process_group()`` forms with
no backend named: a collective on a CPU tensor (a checksum, a count) works beside those on the
GPU, where an NCCL-only group refuses it. ``gloo`` on CPU workers, unless the user picks one.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from monarch_nb.dispatch.dispatch import send_interrupt
from monarch_nb.dispatch.gathering import gather
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.results import CellError, Interrupted
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError
from monarch_nb.rank import mesh as rank_mesh
from monarch_nb.rank import release as rank_release
from monarch_nb.rank import session

DEFAULT_TIMEOUT = 30.0
UNSTICK_WAIT = 3.0  # seconds for a rank waiting in a collective to notice its peers left

_store: dict[str, Any] = {}  # on a worker: the TCPStore rank 0 serves


class DistError(RuntimeError):
    """The process group could not form; the cluster stays usable without it."""


GPU_BACKEND = "cpu:gloo,cuda:nccl"


def default_backend(device_kinds: list[str]) -> str:
    gpus = device_kinds and all(k in ("cuda", "rocm") for k in device_kinds)
    return GPU_BACKEND if gpus else "gloo"


def master_host(address: str) -> str:
    """The host part of rank 0's worker address: the one address every worker can reach."""
    hostport = address.split("://", 1)[-1]
    host = hostport.rsplit(":", 1)[0]
    return host.strip("[]")


def form_group(ctl, backend: str | None = None, timeout: float | None = None) -> str:
    """(Re-)form the default process group over every rank; returns the backend used.
    ``timeout``: how long a collective may wait for its peers (DEFAULT_TIMEOUT)."""
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    kinds = ctl.call(_device_kind).values()
    backend = backend or default_backend(kinds)
    host = master_host(ctl.ranks[0].address)
    # Every rank leaves the old group at once: a rank destroying a group alone waits for its
    # unfinished collectives (an interrupted async all_reduce) until the group's timeout, while
    # the others leaving closes the connections those collectives wait on.
    ctl.call(_leave)
    try:
        port = ctl.call(_open_store, host, ctl.world_size, timeout, targets=[0]).item(0)
        ctl.call(_join, backend, host, port, timeout)
    except CellError as e:
        ctl.call(_leave)
        first = next(iter(e.errors.values()))
        raise DistError(
            f"the {backend} process group could not form ({e.headline}; rank {first.rank}: "
            f"{first.ename}: {first.evalue}); the cluster is usable without it"
        ) from None
    return backend


def form_part(ctl, ranks: list[int], shape: dict[str, int] | None) -> None:
    """A process group of ``ranks`` alone, numbered from 0 in their order, and a device mesh of
    ``shape`` over it in their namespaces: a replica group's replacements, which shard their
    model over it while the other ranks train on (controller/healing.py). The cluster's own
    group forms again over every rank before the next cell."""
    timeout = DEFAULT_TIMEOUT
    backend = ctl.dist_backend or "gloo"
    host = master_host(ctl.ranks[ranks[0]].address)
    port = ctl.call(_open_store, host, len(ranks), timeout, targets=ranks[:1]).item(ranks[0])
    places = {r: (backend, host, port, timeout, i, len(ranks)) for i, r in enumerate(ranks)}
    ctl.call(_join, targets=ranks, per_rank=places)
    if shape:
        ctl.call(rank_mesh.build, tuple(shape), tuple(shape.values()), targets=ranks)


def adopt_group(ctl) -> bool:
    """Take over the process group (and device mesh) the ranks of a kept cluster already have,
    as a notebook attaching to it does: models wrapped in DistributedDataParallel or sharded
    over the mesh keep their groups. Whether it could: every rank in one group of the world's
    size, at its own rank, with one backend (else the caller forms a fresh one)."""
    states = ctl.call(_group_state).values()
    if not states or any(s is None for s in states):
        return False
    if any(s["rank"] != r or s["world"] != ctl.world_size for r, s in enumerate(states)):
        return False
    if len({s["backend"] for s in states}) != 1 or not ctl.dist_wanted:
        return False
    with ctl._group_lock:
        ctl.dist_backend, ctl.dist_error, ctl.regroup_pending = states[0]["backend"], None, False
        meshes = {s["mesh"] for s in states}
        ctl.mesh_shape = dict(meshes.pop()) if len(meshes) == 1 and None not in meshes else None
        ctl.mesh_error = None
    return True


def _group_state(engine) -> dict[str, Any] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return {
        "backend": str(dist.get_backend()),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "mesh": rank_mesh.shape(engine),
    }


def regroup_after_interrupt(ctl, req, outcomes: dict[int, dict]) -> None:
    """After an interrupted cell, form the process group again if the ranks stopped at
    different collectives. A rank interrupted between two collectives leaves a peer waiting
    in the next one (StillRunning until the group's timeout, then the pairs are closed for
    good), or ranks stop one collective apart and the next cell's collectives pair up wrongly.
    Ranks still waiting are set free by cutting the group's connections on every rank
    (rank/release.py); then it forms again, at once or, for a rank still in some other C call,
    before the next cell. Only on the notebook's thread:
    a ``--noblock`` cell's handle leaves the check to the next cell (``form_if_pending``).
    Whatever goes wrong here, the cell's own outcome is what its caller gets.

    A cell whose failed rank released the others (dispatch/releasing.py) cut every group's
    connections, and a collective that gave up left its group useless: either way the group
    forms again, here or before the next cell."""
    if ctl.closed or not ctl.dist_backend or req.kind != "execute":
        return
    released = req.on_failure is not None and req.on_failure.cut_at is not None
    if not released and any(map(_interrupted, outcomes.values())):
        for rank, ev in outcomes.items():  # its collective ended by the interrupt's cut
            if ev.get("collective"):
                outcomes[rank] = _SET_FREE
    if released or any(ev.get("collective") for ev in outcomes.values()):
        why = (
            f"rank {req.on_failure.first} failed while the others waited for it"
            if released
            else "a collective gave up (a peer's connection closed, or the group's timeout)"
        )
        _after_failure(ctl, req, outcomes, why)
        return
    if len(req.ranks) != ctl.world_size:
        return
    stuck = [r for r in req.ranks if r not in outcomes]
    if len(stuck) == len(req.ranks) or not (stuck or any(map(_interrupted, outcomes.values()))):
        return  # nothing was interrupted, or every rank is in a C call: no collective between
    if threading.current_thread() is not threading.main_thread():
        ctl.regroup_pending = True  # checked, and formed if need be, before the next cell
        return
    try:
        counts = _counts(ctl, req.ranks)
        if counts is None or len(set(counts)) == 1:
            return  # unknown, or in step
        if stuck:
            ctl.regroup_pending = True  # from here on the group is being taken down
            # every rank cuts its groups' connections (rank/release.py): a collective waiting
            # on them ends at once, also where a DDP model holds the group
            send_interrupt(ctl, req.ranks, req.id, cut="group")
            with contextlib.suppress(TimeoutError):
                gather(req, Renderer(stuck), time.monotonic() + UNSTICK_WAIT, outcomes)
            for rank in stuck:
                if rank in outcomes:  # set free: its collective failed, as it was meant to
                    outcomes[rank] = _SET_FREE
            still = [r for r in stuck if r not in outcomes]
            if still:
                _say(
                    f"{format_ranks(still)} still waits in a C call: the {ctl.dist_backend} "
                    "process group forms again before the next cell, once that rank is free"
                )
                return
            why = "a rank was left waiting in a collective"
        else:
            why = "collectives done: " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        first = req.on_failure.first if req.on_failure is not None else None
        what = "the interrupt" if first is None else f"rank {first}'s failure"
        _form_again(ctl, f"{what} left the ranks out of step ({why})")
    except KeyboardInterrupt:
        ctl.regroup_pending = True
        _say("interrupted while the process group formed again; it forms before the next cell")
    except Exception as e:  # a rank lost meanwhile, the cluster going down...
        ctl.regroup_pending = True
        _say(
            f"the process group was not formed again after the interrupt ({_short(e)}); "
            "the next cell tries again"
        )


def interrupt_cut(ctl, req) -> str | None:
    """What a ``--noblock`` cell's interrupt cuts besides: "group" where the cell runs on every
    rank and the ranks stand at different collectives, some waiting in one their peers will not
    call, which an interrupt alone does not end (the ranks' thread is in gloo's or NCCL's C
    code). Their collective then fails at once, and the next cell forms the group again
    (``form_if_pending``), as after a blocking cell's interrupt."""
    if ctl.closed or not ctl.dist_backend or ctl.ft is not None or len(req.ranks) != ctl.world_size:
        return None
    try:
        counts = _counts(ctl, req.ranks, timeout=2)
    except Exception:  # a rank lost meanwhile: the interrupt goes as it is
        return None
    return "group" if counts is not None and len(set(counts)) > 1 else None


def _after_failure(ctl, req, outcomes: dict[int, dict], why: str) -> None:
    """The group formed again after ``why``: now, on the notebook's thread with every rank of
    the cell done; else before the next cell (a rank lost: as its replacement joins)."""
    ctl.regroup_pending = True
    if threading.current_thread() is not threading.main_thread():
        return
    if any(ev.get("status") == "lost" for ev in outcomes.values()):
        return
    still = [r for r in req.ranks if r not in outcomes]
    if still:
        _say(
            f"{why}; {format_ranks(still)} still runs (in a C call), and the "
            f"{ctl.dist_backend} process group forms again before the next cell, once it is free"
        )
        return
    try:
        _form_again(ctl, why)
    except KeyboardInterrupt:
        ctl.regroup_pending = True
        _say("interrupted while the process group formed again; it forms before the next cell")
    except Exception as e:  # a rank lost meanwhile, the cluster going down...
        ctl.regroup_pending = True
        _say(f"the process group was not formed again ({_short(e)}); the next cell tries again")


def form_if_pending(ctl, ranks: list[int]) -> None:
    """Before a cell on every rank: the group an interrupt may have left out of step (a rank
    still in a collective, a ``--noblock`` cell interrupted) is checked, and formed again
    where the ranks' collective counts differ, once a rank still in its collective is free
    (the cell would wait behind it anyway). Ctrl-C stops waiting; the cell is not sent."""
    if not ctl.regroup_pending or len(ranks) != ctl.world_size:
        return
    busy = sorted(set(ctl._router.busy()))
    if busy:
        _say(
            f"forming the process group again first: waiting for {format_ranks(busy)} "
            "(interrupt to stop waiting)"
        )
    try:
        counts = _counts(ctl, list(range(ctl.world_size))) if not busy else None
        if counts is not None and len(set(counts)) == 1 and -1 not in counts:
            ctl.regroup_pending = False  # in step after all
            return
        pending = ctl.regroup_pending  # True, or why (attach.py: a rank replaced meanwhile)
        why = (
            pending if isinstance(pending, str) else "after an interrupt the ranks were out of step"
        )
        _form_again(ctl, why)
    except CellError as e:
        if not e.headline.startswith("interrupted"):
            raise _controller_error(
                f"the process group could not form again ({e.headline}); the cell was not sent"
            ) from None
        raise Interrupted(
            "stopped waiting to form the process group again; the cell was not sent (the next "
            "one tries again)"
        ) from None


def _counts(ctl, ranks: list[int], timeout: float = 5) -> list[int] | None:
    """Each rank's count of collectives on the default group, read on its event loop (also
    while its thread waits in one); None where a rank did not say. Equal counts mean in step:
    a rank still running then is in some other C call, which the group has nothing to do with."""
    info = ctl.rank_info(ranks, timeout=timeout)
    counts = [info.get(r, {}).get("info", {}).get("collectives") for r in ranks]
    return None if None in counts else counts


def _form_again(ctl, why: str) -> None:
    ctl.regroup_pending = False
    try:
        ctl._form_group()
    except BaseException:
        ctl.regroup_pending = True
        raise
    if ctl.dist_backend:
        again = "wrap models in DistributedDataParallel again"
        if ctl.mesh_shape:
            again += ", shard them again over the new `mesh`"
        if ctl.ft is not None:  # torchft's DDP has groups of its own
            again = "models of ft.wrap that are not sharded go on as they are; " + again.replace(
                "models", "others", 1
            )
        _say(f"{why}; the {ctl.dist_backend} process group was formed again ({again})")
    else:
        _say(f"the process group could not form again: {ctl.dist_error}")


def _short(e: BaseException) -> str:
    return (getattr(e, "headline", None) or str(e) or type(e).__name__).splitlines()[0]


def _controller_error(text: str) -> Exception:

    return ClusterError(text)


_SET_FREE = {
    "ev": "done",
    "status": "error",
    "error": {
        "ename": "KeyboardInterrupt",
        "evalue": "interrupted while it waited in a collective the other ranks had left",
        "traceback": [],
    },
}


def _interrupted(ev: dict) -> bool:
    """Stopped by an interrupt: the user's, or another rank's failure (Released)."""
    return ev.get("status") == "error" and ev["error"].get("ename") in (
        "KeyboardInterrupt",
        "Released",
    )


def _say(text: str) -> None:
    print(f"monarch-nb: {text}", file=sys.stderr, flush=True)


def _device_kind(engine) -> str:
    return engine.device_info.get("kind", "cpu")


def _open_store(engine, host: str, world_size: int, timeout: float) -> int:
    import torch.distributed as dist

    _leave(engine)
    # Listen on rank 0's worker address only: a TCPStore left to itself listens on every
    # interface, which would expose the store beyond 127.0.0.1 on a local cluster.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(max(128, world_size))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
    )
    _store["master"] = store
    return store.port


def _join(
    engine, backend: str, host: str, port: int, timeout: float, place=None, size=None
) -> None:
    """Join the default group at this rank's place (``place`` of ``size``: in a part of the
    ranks, ``form_part``)."""
    import torch.distributed as dist

    rank, world_size = engine.identity["rank"], engine.identity["world_size"]
    if size is not None:
        rank, world_size = place, size
    _destroy()
    _unpin()
    rank_release.track(port)  # what a failed peer's release cuts (rank/release.py)
    if rank == 0:
        store = _store["master"]
    else:
        store = dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
    with session.coarse_timers():  # an idle group's gloo loop: ~30 wake-ups a second, not 100
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    session.quiet_pollers()  # where allowed: ~10


def _unpin() -> None:
    """torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default,
    evaluated as it is first imported: imported while a group exists (torch.distributed.checkpoint,
    FSDP and ShardedTensor import it), it holds that group for ever, so leaving the group closes
    none of its connections and a peer waiting in a collective with this rank is not set free
    (after an interrupt) until the group's timeout. Imported with no group, the default is None."""
    import torch.distributed.nn.functional  # noqa: F401


def _leave(engine) -> None:
    rank_mesh.drop(engine)  # its groups go with the default one
    _destroy()
    _store.pop("master", None)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        session.quiet_pollers(None)  # gloo waits for its loop's wake-ups as it closes
        dist.destroy_process_group()
    rank_release.forget()
