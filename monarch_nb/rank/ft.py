"""Fault-tolerant training on the ranks, through torchft: ``from monarch_nb import ft``.

On a cluster started with ``--ft`` (``up(ft=True)``) every rank knows where torchft's Lighthouse
is. In a ``%%monarch`` cell::

    model, opt = ft.wrap(model, opt)      # one replica group per rank
    for step in ft.steps(200):            # the committed steps
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()                        # applied only where the quorum commits the step

A rank that dies does not fail the cell: the others go on with fewer participants, and its
replacement, once the notebook has run the ``--setup`` cells and this cell on it, heals from a
live peer (model, optimizer, step) at its first quorum and finishes the loop with them
(dispatch/healing.py). Each rank tells the notebook its committed steps and quorum as it goes.

In the notebook, ``ft.history()`` is what happened: every loss, join, heal and return;
``ft.quorum()`` the last quorum the ranks reported.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from monarch_nb.errors import ClusterError, current
from monarch_nb.rank import ft_hsdp, ft_torch, release
from monarch_nb.rank.capture import current_capture

LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # set on every rank of a cluster started with --ft
NOT_FT = (
    "this cluster was started without --ft, so torchft has no Lighthouse here: %monarch down, "
    "then %monarch up --ft (or up(ft=True))"
)
REPORT_EVERY = 0.1  # seconds between two reports of an unchanged quorum to the notebook
LINGER = 180.0  # the longest a rank whose loop is done waits for a replacement to heal from it
GATHER = 30.0  # the longest a loop's first quorum waits for the cell's other ranks

_pending: dict[str, set[int]] = {}  # cell id -> its ranks yet to finish the loop (the notebook's)
_floor: dict[str, int] = {}  # cell id -> the step a replacement's first quorum must reach

_state: _Wrapped | None = None  # this rank's wrapped model, optimizer and Manager


class _Wrapped:
    def __init__(self, manager, model, optimizer, group: ft_hsdp.Group | None = None):
        self.manager, self.model, self.optimizer = manager, model, optimizer
        self.group = group  # a sharded model's replica group (ft_hsdp.py); None: DDP, one rank
        self.quorum_started = False  # ft.steps started this step's quorum (not zero_grad)
        self.stepped = 0  # the optimizer's step() calls: a loop that never calls it stops


def wrap(model, optimizer, *, min_replicas: int = 1, timeout: float = 10.0, **manager_options):
    """The model as torchft's DistributedDataParallel and the optimizer as its Optimizer, over
    a torchft ``Manager`` for this rank's replica group (one rank each). A model already
    sharded with ``fully_shard`` over the mesh's last dimension is kept as it is: its replica
    group is its slice of the mesh (HSDP, ft_hsdp.py). ``min_replicas``: the fewest replica
    groups a step may commit with; ``timeout``: seconds for a collective, a commit or a heal;
    anything else is the Manager's own keyword (``quorum_timeout``, ``init_sync`` ...)."""
    global _state
    address = os.environ.get(LIGHTHOUSE)
    if not address:
        raise ClusterError(NOT_FT)
    world = _world_size()
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(
            f"min_replicas must be a whole number of ranks, 1 or more; got {min_replicas!r}"
        )
    group = ft_hsdp.group_of(model, _rank(), world) if _sharded(model) else None
    replicas = world if group is None else world // group.size
    if min_replicas > replicas:
        groups = "ranks" if group is None else f"replica groups of {group.size} ranks"
        raise ValueError(
            f"min_replicas={min_replicas} is more than the {replicas} {groups} of this cluster: "
            f"no step could ever commit; give at most {replicas}"
        )
    torchft, ddp = ft_torch.load()
    step = carry = None
    if _state is not None:
        if model is _state.model:  # the cell again (after Ctrl-C, a new Lighthouse): its
            step = _state.manager.state_dict()  # step goes on
            if _state.group is None:  # and the old wrapper lets go of it
                model = _state.model.module
                _state.model.reducer._remove_autograd_hooks()
        elif group is not None and _state.group is not None and not ft_hsdp.formed(_state.model):
            # the sharded model wrapped before the cluster's group formed again, unusable now,
            # goes on in this one, sharded anew (the --setup cells run again)
            carry = ft_hsdp.carried(_state.model, _state.optimizer.optim, model)
            step = _state.manager.state_dict() if carry is not None else None
        if optimizer is _state.optimizer:
            optimizer = _state.optimizer.optim
        _close(_state)
        _state = None
    from torch.distributed import TCPStore

    on_gpu = any(p.is_cuda for p in model.parameters())
    host = _host()
    if group is None:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        store_at = (host, store.port)
    else:
        store, store_at = ft_hsdp.group_store(group, host)
    step_timeout = timedelta(seconds=timeout)
    pg = (torchft.ProcessGroupNCCL if on_gpu else ft_torch.gloo_group(torchft))(
        timeout=step_timeout
    )

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    if group is not None:
        state_dict, load_state_dict = ft_hsdp.state_fns(model, optimizer)

    options = {
        "timeout": step_timeout,
        "quorum_timeout": timedelta(seconds=max(30.0, 3 * timeout)),
        "connect_timeout": step_timeout,
        **manager_options,
    }
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replicas,
        replica_id=f"rank{_rank()}" if group is None else f"replica{group.index}",
        rank=0 if group is None else group.rank,
        world_size=1 if group is None else group.size,
        store_addr=store_at[0],
        store_port=store_at[1],
        lighthouse_addr=address,
        hostname=host,
        **options,
    )
    manager._monarch_store = store  # the replica group's store lives as long as its Manager
    if group is None:
        ft_torch.own_vote(manager)
    if step is not None:
        manager.load_state_dict(step)
    if carry is not None:
        load_state_dict(carry)
        print(
            "ft.wrap: the model trained before the process group formed again goes on in this "
            f"one, at step {manager.current_step()}",
            flush=True,
        )
    wrapped = _Wrapped(manager, ddp(manager, model) if group is None else model, None, group)
    wrapped.optimizer = ft_torch.optimizer_class(torchft)(wrapped, optimizer)
    _state = wrapped
    return wrapped.model, wrapped.optimizer


def steps(n: int):
    """The steps ``0 .. n-1`` that this replica takes part in, each yielded once the step's
    quorum has started; the loop's body must call the wrapped optimizer's ``step()``, which
    commits it where every participant got its gradients. A replacement's first quorum heals it
    from a live peer, so its loop starts at the step the others are at."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"ft.steps takes a whole number of steps, 0 or more; got {n!r}")
    if _state is None:
        raise RuntimeError("ft.steps needs ft.wrap(model, optimizer) first, on every rank")
    return _steps(_state, n)


def _steps(state: _Wrapped, n: int):
    manager = state.manager
    reporter = _Reporter(manager, [_rank()] if state.group is None else state.group.ranks)
    first = True
    while first or manager.current_step() < n:
        _quorum(manager, wait=first)
        state.quorum_started = True
        if first:
            first = False
            _reach_floor(manager)
            reporter.report(force=True)
            if manager.current_step() >= n:
                break
        before = state.stepped
        yield manager.current_step()
        if state.stepped == before:
            raise RuntimeError(
                "ft.steps: the loop's body must call the wrapped optimizer's step() once per step "
                "(the one ft.wrap returned): without it no step commits and the loop never ends"
            )
        reporter.report()
    reporter.report(force=True, done=True)
    cap = current_capture()
    _linger(manager, cap[1] if cap is not None else None)


def _reach_floor(manager) -> None:
    """A replacement's first quorum must heal it to the step the others were at when it came
    back: a quorum of replacements alone (the only rank that holds the state busy elsewhere, or
    slow to ask) would start them from step 0. Quorums are asked again until one with that rank
    heals them, for up to ``LINGER`` seconds."""
    cap = current_capture()
    cell_id = cap[1] if cap is not None else None
    floor = _floor.get(cell_id)
    if floor is None:
        _gather(manager, cell_id)
        return
    deadline = time.monotonic() + LINGER
    while manager.current_step() < floor:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"ft.steps: no quorum healed this replacement to step {floor}, where the others "
                f"were, within {LINGER:.0f} s"
            )
        time.sleep(0.1)
        _quorum(manager, wait=True)


def _gather(manager, cell_id: str | None) -> None:
    """The loop's first quorum waits for every rank of the cell (for up to ``GATHER``
    seconds): torchft forms one with whichever Managers heartbeat, so the first rank to get
    there would otherwise take its first steps alone while the others import torchft."""
    me, deadline = _rank(), time.monotonic() + GATHER
    while time.monotonic() < deadline:
        told = _pending.get(cell_id)
        want = set(range(_world_size())) if told is None else told
        if not want - {me} - _in_quorum(manager):
            return
        time.sleep(0.05)
        _quorum(manager, wait=True)


def _linger(manager, cell_id: str | None) -> None:
    """The loop is done here while another rank of the cell may still come to it: one that
    started late, or a lost rank's replacement on its way back. This rank keeps answering
    quorums, without stepping, until each rank the notebook counts as still to finish the loop
    (``pending``; every rank, until it says) has been in one with it: the late one heals from
    it to the last step and ends its loop there, where it would otherwise find nobody to form a
    quorum with. In the usual end every rank is in the last step's quorum, and nobody waits."""
    me, world = _rank(), _world_size()
    deadline = time.monotonic() + LINGER
    while time.monotonic() < deadline:
        told = _pending.get(cell_id)
        pending = set(range(world)) if told is None else told
        if not pending - {me} - _in_quorum(manager):
            return
        _quorum(manager, wait=True)
        time.sleep(0.05)


def _in_quorum(manager) -> set[int]:
    """The ranks in this rank's last quorum, a healing one included: every rank of each
    replica group in it (torchft's ranks of a quorum are those at this rank's place)."""
    size = manager._group_world_size or 1
    groups = {r // size for r in getattr(manager._pg, "_global_ranks", None) or ()}
    return {g * size + i for g in groups for i in range(size)}


def told(msg: dict) -> None:
    """From the notebook, on the worker's event loop (healing.py): the ranks of cell
    ``msg["id"]`` that have not finished its loop; ``lost``: one was just lost, and this rank's
    torchft groups are cut (rank/release.py), so that a collective waiting on a peer that waits
    on the lost one fails now, not when the next quorum forms without this rank (the
    Lighthouse's join timeout, 5 s); ``at_least``, to a replacement: the step the others are at,
    which its first quorum must heal it to."""
    _pending.clear()  # one cell at a time
    _pending[msg["id"]] = set(msg["ranks"])
    if msg.get("at_least") is not None:
        _floor.clear()
        _floor[msg["id"]] = msg["at_least"]
    if msg.get("lost"):
        release.cut(ft=True)


def history():
    """In the notebook: the fault-tolerance events of the current cluster, oldest first, each
    a dict with ``time``, ``rank``, ``event`` ("lost", "joining", "healing", "back"), ``step``
    and ``participants``."""
    ctl = current()
    if ctl is None:
        raise ClusterError("no cluster: %monarch up --ft starts one")
    return [dict(e) for e in ctl.ft_events]


def quorum() -> dict:
    """In the notebook: the last quorum the ranks reported, ``{"quorum": id, "participants":
    n, "step": committed steps, "ranks": [...]}`` (empty before any ``ft.steps`` loop)."""
    ctl = current()
    if ctl is None:
        raise ClusterError("no cluster: %monarch up --ft starts one")
    return dict(ctl.ft_quorum)


def manager():
    """This rank's torchft Manager (after ``ft.wrap``): its quorum, step and participants."""
    if _state is None:
        raise RuntimeError("ft.manager() needs ft.wrap(model, optimizer) first")
    return _state.manager


class _Reporter:
    """Tells the notebook this rank's committed step and quorum, as a cell's event: at a change
    of quorum or participants, else at most every ``REPORT_EVERY`` seconds."""

    def __init__(self, manager, group: list[int]):
        self.manager, self.group = manager, group  # the ranks of this one's replica group
        self.last: tuple | None = None
        self.at = 0.0

    def report(self, force: bool = False, done: bool = False) -> None:
        m = self.manager
        participating = done or m.is_participating()  # one done is not healing any more
        quorum = (m._quorum_id, m._participating_replica_world_size, participating)
        now = time.monotonic()
        if not force and quorum == self.last and now - self.at < REPORT_EVERY:
            return
        self.last, self.at = quorum, now
        cap = current_capture()
        if cap is None:
            return
        outbox, cell_id = cap
        qid, n, participating = quorum
        outbox.emit(
            {
                "ev": "ft",
                "id": cell_id,
                "step": m.current_step(),
                "quorum": qid,
                "participants": n,
                "healing": not participating,
                "done": done,
                "group": self.group,
            }
        )


def _quorum(manager, wait: bool) -> None:
    """Start this step's quorum (and wait for it: a replacement heals in its first), saying in
    one line why it could not be had."""
    try:
        manager.start_quorum()
        if wait:
            ft_torch.await_quorum(manager)
            manager.wait_quorum()
            if manager._healing:
                # A replacement's first quorum healed it: its state is applied now, as torchft
                # does for a synchronous quorum, so that its first step runs the live model
                # (torchft's asynchronous quorum would apply it after that step's backward).
                manager._apply_pending_state_dict()
                manager._healing = False
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(
            f"torchft could not form a quorum ({text[:200]}): the Lighthouse at "
            f"{os.environ.get(LIGHTHOUSE)} is gone or too few ranks are left; %monarch status "
            "says which"
        ) from None


def _sharded(model) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


def _close(state: _Wrapped) -> None:
    """Shut the previous Manager down in the background: its servers' shutdown waits for a
    quorum request still in flight (one to a Lighthouse that exited waits out its timeout)."""

    def shutdown() -> None:
        with contextlib.suppress(Exception):  # a Manager whose servers are already gone
            state.manager.shutdown(wait=False)

    threading.Thread(target=shutdown, daemon=True, name="monarch-ft-shutdown").start()


def _rank() -> int:
    return int(_identity("rank", 0))


def _world_size() -> int:
    return int(_identity("world_size", 1))


def _identity(name: str, default):
    engine = _engine()
    if engine is None or not engine.identity:
        return default
    return engine.identity.get(name, default)


def _engine():
    """This worker process's engine (its ``monarch`` extension), if any: the engine's thread,
    which runs the cells, is not a Dask task's, so ``get_worker()`` does not know it."""
    from distributed import Worker

    for worker in list(Worker._instances):
        engine = worker.extensions.get("monarch")
        if engine is not None:
            return engine
    return None


def _host() -> str:
    """The address the other ranks reach this one at: its Dask worker's."""
    engine = _engine()
    if engine is not None:
        return engine.worker.ip
    return socket.gethostbyname(socket.gethostname())
