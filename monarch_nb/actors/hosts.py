"""PyTorch Monarch's way to get processes: ``this_host().spawn_procs(per_host={"gpus": 4})`` and
``this_proc()``.

torchmonarch starts new processes for every ``spawn_procs``. Here the processes are the
cluster's workers, one per GPU, which the notebook's cells, live panel and sidebar already know:
a process mesh is the first N ranks of the host, shaped by ``per_host``'s dimensions (any names,
in their order). Where no cluster is up, one of N workers is started for it (and closed when the
process exits, for a script); where the cluster this kernel started has fewer ranks on the host,
it grows to N. Several meshes may share processes: each spawn still makes actors of its own, on
threads of their own. ``this_proc()`` is the caller's own process (inprocess.py), or inside an
actor the worker it runs on.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import math
import threading

from monarch_nb.actors import inprocess
from monarch_nb.actors.caller import _controller_state
from monarch_nb.actors.extent import Extent
from monarch_nb.actors.here import current_host
from monarch_nb.actors.mesh import ProcMesh, _Life, _members_of
from monarch_nb.actors.shape import _Member
from monarch_nb.controller import capacity
from monarch_nb.errors import ClusterError
from monarch_nb.errors import current as current_controller

_started: list = []  # clusters spawn_procs started in this process: closed at its exit
_lock = threading.Lock()


class HostMesh:
    """The machine the notebook (or script) runs on: the first host of its cluster. It has no
    dimensions of its own, so a process mesh's are those of ``per_host``."""

    extent = Extent([], [])

    def spawn_procs(
        self,
        per_host: dict[str, int] | None = None,
        bootstrap=None,
        name: str | None = None,
        proc_bind=None,
        bootstrap_command=None,
    ) -> ProcMesh:
        """A ProcMesh of ``prod(per_host.values())`` of the cluster's processes on this host,
        with ``per_host``'s dimensions; ``bootstrap()`` (plain or ``async``) runs once on each
        before it is returned. ``name`` is torchmonarch's label and changes nothing here."""
        if proc_bind is not None or bootstrap_command is not None:
            which = "proc_bind" if proc_bind is not None else "bootstrap_command"
            raise TypeError(
                f"spawn_procs(..., {which}=...) is not supported: the processes are the "
                "cluster's Dask workers, started already; bind or launch them through the "
                "cluster (see docs/scaling-out.md)"
            )
        shape = _shape(per_host)
        n = math.prod(shape.values())
        ctl = _cluster_for(n, shape)
        first = ctl.ranks[0].host
        ranks = [info for info in ctl.ranks if info.host == first][:n]
        mesh = ProcMesh(_members_of(ctl, ranks), shape, range(n))
        mesh._box, mesh._life, mesh._points = _controller_state(ctl).mailbox, _Life(), True
        if bootstrap is not None:
            _bootstrap(ctl, [info.rank for info in ranks], bootstrap)
        return mesh

    def __repr__(self) -> str:
        return "<HostMesh this_host()>"


def this_host() -> HostMesh:
    """The machine the notebook or script runs on (torchmonarch's ``this_host()``)."""
    if current_host() is not None and current_controller() is None:
        raise ClusterError(
            "this_host() is the notebook's (or script's): an actor spawns on a ProcMesh "
            "passed in as an argument, or on this_proc()"
        )
    return HostMesh()


def this_proc() -> ProcMesh:
    """The caller's own process as a mesh of one: the notebook's (or script's) own, where
    actors run on threads of their own, or inside an actor the worker it runs on."""
    host = current_host()
    if host is not None:  # an actor: its worker
        worker = host.worker
        identity = getattr(worker.extensions.get("monarch"), "identity", {})
        member = _Member(identity.get("rank", 0), worker.address, _host_of(worker.address))
        mesh = ProcMesh([member], {}, [0])
    else:
        here = inprocess.here()
        member = _Member(inprocess.CLIENT_RANK, here.address, here.host_name)
        mesh = ProcMesh([member], {}, [0], here.box)
    mesh._life, mesh._points = _Life(), True
    return mesh


def _host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def _shape(per_host) -> dict[str, int]:
    """``per_host`` checked: dimension names (identifiers, each once) and whole sizes of at
    least 1, each mistake in one line."""
    if per_host is None:
        return {}
    if not isinstance(per_host, dict):
        raise TypeError(
            f"per_host takes a dict of dimension sizes, e.g. {{'gpus': 4}}, not "
            f"{type(per_host).__name__}"
        )
    for label, size in per_host.items():
        if not isinstance(label, str) or not label.isidentifier():
            raise ValueError(
                f"per_host dimension name {label!r} must be a name like 'gpus' (it is used as "
                "mesh.slice(gpus=0))"
            )
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"per_host[{label!r}] must be a whole number, not {size!r}")
        if size < 1:
            raise ValueError(f"per_host[{label!r}] is {size}: each dimension needs at least 1")
    return dict(per_host)


def _cluster_for(n: int, shape: dict[str, int]):
    """The cluster whose first host has ``n`` processes for the mesh: the current one, grown
    where this kernel started it, or one started for it."""
    asked = f"spawn_procs(per_host={shape}) ({n} process{'es' if n != 1 else ''})"
    with _lock:
        ctl = current_controller()
        if ctl is None or ctl.closed:
            return _start(n, asked)
    first = ctl.ranks[0].host
    here = sum(1 for info in ctl.ranks if info.host == first)
    if here >= n:
        return ctl
    if not ctl.owns_cluster or len({info.host for info in ctl.ranks}) > 1:
        raise ClusterError(
            f"{asked} needs {n} processes on one host, and the cluster has {here} on {first}: "
            "ask for fewer, or start the cluster with more"
        )
    capacity.check(ctl.world_size, ctl.world_size + n - here, local=True, asked=asked)
    ctl.scale(ctl.world_size + n - here)
    return ctl


def _start(n: int, asked: str):
    from monarch_nb.controller.start import up

    capacity.check(0, n, local=True, asked=asked)
    ctl = up(workers=n, dist=False)
    if not _started:
        atexit.register(_close_started)
    _started.append(ctl)
    return ctl


def _close_started() -> None:
    """At the exit of a script whose spawn_procs started its cluster: close it, quietly."""
    for ctl in _started:
        if not ctl.closed:
            ctl.down()


def _bootstrap(ctl, ranks: list[int], bootstrap) -> None:
    fn = bootstrap
    if inspect.iscoroutinefunction(bootstrap):

        def fn():
            return asyncio.run(bootstrap())

    ctl.apply(fn, targets=ranks)
