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

In the notebook, ``ft.history()`` is what happened: every loss, join, heal and return.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

from monarch_nb.errors import ClusterError, current
from monarch_nb.rank import release
from monarch_nb.rank.capture import current_capture

LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # set on every rank of a cluster started with --ft
NOT_FT = (
    "this cluster was started without --ft, so torchft has no Lighthouse here: %monarch down, "
    "then %monarch up --ft (or up(ft=True))"
)
REPORT_EVERY = 0.1  # seconds between two reports of an unchanged quorum to the notebook
LINGER = 180.0  # the longest a rank whose loop is done waits for a replacement to heal from it

_pending: dict[str, set[int]] = {}  # cell id -> its ranks yet to finish the loop (the notebook's)

_state: _Wrapped | None = None  # this rank's wrapped model, optimizer and Manager


class _Wrapped:
    def __init__(self, manager, model, optimizer):
        self.manager, self.model, self.optimizer = manager, model, optimizer
        self.quorum_started = False  # ft.steps started this step's quorum (not zero_grad)
        self.stepped = 0  # the optimizer's step() calls: a loop that never calls it stops


def wrap(model, optimizer, *, min_replicas: int = 1, timeout: float = 10.0, **manager_options):
    """The model as torchft's DistributedDataParallel and the optimizer as its Optimizer, over
    a torchft ``Manager`` for this rank's replica group (one rank each). ``min_replicas``: the
    fewest ranks a step may commit with; ``timeout``: seconds for a collective, a commit or a
    heal; anything else is the Manager's own keyword (``quorum_timeout``, ``init_sync`` ...).
    A model already sharded with ``fully_shard`` is not taken yet (see docs/training.md)."""
    global _state
    address = os.environ.get(LIGHTHOUSE)
    if not address:
        raise ClusterError(NOT_FT)
    world = _world_size()
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(
            f"min_replicas must be a whole number of ranks, 1 or more; got {min_replicas!r}"
        )
    if min_replicas > world:
        raise ValueError(
            f"min_replicas={min_replicas} is more than the {world} ranks of this cluster: no "
            f"step could ever commit; give at most {world}"
        )
    if _sharded(model):
        raise NotImplementedError(
            "ft.wrap takes a plain model (one replica group per rank); a model sharded with "
            "fully_shard is not supported yet"
        )
    torchft, ddp = _torchft()
    step = None
    if _state is not None:
        if model is _state.model:  # the cell again (after Ctrl-C, a new Lighthouse): its
            model = _state.model.module  # step goes on, and the old wrapper lets go of it
            _state.model.reducer._remove_autograd_hooks()
            step = _state.manager.state_dict()
        if optimizer is _state.optimizer:
            optimizer = _state.optimizer.optim
        _close(_state)
        _state = None
    from torch.distributed import TCPStore

    on_gpu = any(p.is_cuda for p in model.parameters())
    host = _host()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    step_timeout = timedelta(seconds=timeout)
    pg = (torchft.ProcessGroupNCCL if on_gpu else _gloo(torchft))(timeout=step_timeout)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

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
        replica_id=f"rank{_rank()}",
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=address,
        hostname=host,
        **options,
    )
    manager._monarch_store = store  # the replica group's store lives as long as its Manager
    if step is not None:
        manager.load_state_dict(step)
    wrapped = _Wrapped(manager, ddp(manager, model), None)
    wrapped.optimizer = _optimizer_class(torchft)(wrapped, optimizer)
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
    reporter = _Reporter(manager)
    first = True
    while first or manager.current_step() < n:
        _quorum(manager, wait=first)
        state.quorum_started = True
        if first:
            first = False
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
    """The ranks in this rank's last quorum, a healing one included."""
    return set(getattr(manager._pg, "_global_ranks", None) or ())


def pending(cell_id: str, ranks, lost: bool = False) -> None:
    """From the notebook, on the worker's event loop: the ranks of cell ``cell_id`` that have
    not finished its loop (healing.py). ``lost``: one was just lost, and this rank's torchft
    groups are cut (rank/release.py), so that a collective waiting on a peer that waits on the
    lost one fails now, not when the next quorum forms without this rank (the Lighthouse's
    join timeout, 5 s)."""
    _pending.clear()  # one cell at a time
    _pending[cell_id] = set(ranks)
    if lost:
        release.cut(ft=True)


def history():
    """In the notebook: the fault-tolerance events of the current cluster, oldest first, each
    a dict with ``time``, ``rank``, ``event`` ("lost", "joining", "healing", "back"), ``step``
    and ``participants``."""
    ctl = current()
    if ctl is None:
        raise ClusterError("no cluster: %monarch up --ft starts one")
    return [dict(e) for e in ctl.ft_events]


def manager():
    """This rank's torchft Manager (after ``ft.wrap``): its quorum, step and participants."""
    if _state is None:
        raise RuntimeError("ft.manager() needs ft.wrap(model, optimizer) first")
    return _state.manager


class _Reporter:
    """Tells the notebook this rank's committed step and quorum, as a cell's event: at a change
    of quorum or participants, else at most every ``REPORT_EVERY`` seconds."""

    def __init__(self, manager):
        self.manager = manager
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
            }
        )


def await_quorum(manager) -> None:
    """Wait for the step's quorum in steps of 0.1 s: an interrupt (Ctrl-C, another rank's
    failure) lands within one, where torchft's own wait (a lock's) would hold it until the
    quorum's timeout."""
    future = manager._quorum_future
    while future is not None and not future.done():
        with contextlib.suppress(TimeoutError):
            future.result(timeout=0.1)


def _gloo(torchft):
    class ProcessGroupGloo(torchft.ProcessGroupGloo):
        """torchft's gloo group, whose connections are recorded as it forms at each new quorum,
        so that a release cuts them (rank/release.py) as it cuts the cluster's own groups'."""

        def _create_pg(self, store, rank, world_size):
            with release.recorded(ft=True):
                return super()._create_pg(store, rank, world_size)

    return ProcessGroupGloo


def _quorum(manager, wait: bool) -> None:
    """Start this step's quorum (and wait for it: a replacement heals in its first), saying in
    one line why it could not be had."""
    try:
        manager.start_quorum()
        if wait:
            await_quorum(manager)
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


def _optimizer_class(torchft):
    class Optimizer(torchft.Optimizer):
        """torchft's Optimizer, whose zero_grad starts no second quorum in a step that
        ft.steps started one for."""

        def __init__(self, state: _Wrapped, optim):
            super().__init__(state.manager, optim)
            self._monarch_state = state

        def zero_grad(self, set_to_none: bool = True) -> None:
            state = self._monarch_state
            if state.quorum_started:
                state.quorum_started = False
                self.optim.zero_grad(set_to_none)
            else:
                super().zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            self._monarch_state.quorum_started = False
            self._monarch_state.stepped += 1
            await_quorum(self.manager)
            super().step(closure)

    return Optimizer


def _torchft():
    """torchft, quietened (its Rust servers log every quorum at INFO, its checkpoint server
    every request), and the DistributedDataParallel this module wraps models in."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        from torchft import ddp
    except ImportError as e:
        raise ClusterError(
            f"torchft cannot be imported on this rank ({e}): pip install torchft, or make lab / "
            "make test, which install it"
        ) from None
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    _quiet_checkpoint_server()
    _spend_reducer_warning(ddp)

    class DistributedDataParallel(ddp.DistributedDataParallel):
        """torchft's DDP whose gradient hook never raises: an allreduce that failed (a peer
        died) is reported to the Manager, which then does not commit the step, instead of
        failing the backward pass on every survivor as the underlying future would."""

        @staticmethod
        def _comm_hook(state, bucket):
            import torch

            await_quorum(state)
            work = state.allreduce(bucket.buffer())
            work.wait()  # a failure is the Manager's now: should_commit says no
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

    return torchft, DistributedDataParallel


def _quiet_checkpoint_server() -> None:
    """torchft's checkpoint server logs every request a healing peer makes on stderr, which
    is the cell's output: its successful requests are not logged (its errors still are)."""
    from torchft import http

    server = http._IPv6HTTPServer
    if getattr(server, "_monarch_quiet", False):
        return
    init = server.__init__

    def quiet_init(self, address, handler, *args, **kwargs):
        handler.log_request = lambda self, code="-", size="-": None
        init(self, address, handler, *args, **kwargs)

    server.__init__ = quiet_init
    server._monarch_quiet = True


_reducer_warned = False


def _spend_reducer_warning(ddp) -> None:
    """torchft's DDP sets ``find_unused_parameters`` (its buckets must never be rebuilt), and
    torch's reducer then warns, once per process and from C++ straight to fd 2 (the cell's
    output), that no parameter went unused. It is spent here on a model of one parameter, with
    fd 2 pointed at /dev/null for that moment."""
    global _reducer_warned
    if _reducer_warned:
        return
    _reducer_warned = True
    import torch
    from torch.nn import parallel
    from torchft.process_group import ProcessGroupDummy

    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        model = parallel.DistributedDataParallel(
            torch.nn.Linear(1, 1),
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
        )
        model(torch.ones(1, 1)).sum().backward()
    except Exception:
        pass  # only a warning was at stake
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


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
