"""The single controller: the Dask client, the rank table, dispatch to ranks, gathering, interrupt.

``up()`` and ``connect()`` (``start.py``) make one and make it current; the magics drive the
current one, and scripts and tests can use the object directly::

    ctl = monarch_nb.up(workers=2, cpu=True)
    ctl.run("x = rank * 10")
    ctl.pull("x")            # ValueMesh({0: 0, 1: 10})
    ctl.down()

``Controller`` holds the state and is the API; the work is done by plain functions over it, a
module per concern: ``attach`` (the rank table, links to the engines, replacing a lost worker),
``dispatch`` (requests, gathering, interrupts, info), ``data`` (push, pull, scatter, gather,
apply, map), ``status`` and ``lifecycle`` (restart, down). Those modules, and ``dist``, read
and write the underscored attributes below; nothing outside this package does.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from monarch_nb import errors, registry
from monarch_nb.controller import (
    attach,
    data,
    healing,
    keep,
    lifecycle,
    lighthouse,
    profiling,
    scale,
    setup_cells,
    stacks,
    status,
)
from monarch_nb.controller import (
    mesh as device_mesh,
)
from monarch_nb.controller import sync as code_sync
from monarch_nb.controller.dist import (
    DistError,
    adopt_group,
    form_group,
    form_if_pending,
    interrupt_cut,
    regroup_after_interrupt,
)
from monarch_nb.dispatch import dispatch, gathering, interrupting, syntax
from monarch_nb.dispatch.handles import CellHandle
from monarch_nb.dispatch.links import Link, RankInfo, Router
from monarch_nb.dispatch.output import Renderer, live_sink
from monarch_nb.dispatch.reader import Reader
from monarch_nb.dispatch.results import Interrupted, ValueMesh
from monarch_nb.dispatch.targets import format_ranks, parse_targets
from monarch_nb.errors import ClusterError
from monarch_nb.rank import autoreload as rank_autoreload
from monarch_nb.rank import remote
from monarch_nb.rank.engine import PLUGIN_NAME, EnginePlugin
from monarch_nb.telemetry import dashboard, metrics


class Controller:
    """Drives the ranks of one cluster from this process."""

    def __init__(
        self,
        client,
        cluster=None,
        owns_cluster=False,
        expected: int | None = None,
        dist: bool = True,
        backend: str | None = None,
        mesh: device_mesh.Shape | None = None,
        kept: dict[str, Any] | None = None,
        ft: lighthouse.Lighthouse | None = None,
    ):
        self.client = client
        # Kept: the client forgets its scheduler once it closes, and messages still name it.
        self._scheduler_address = client.scheduler.address
        self.cluster = cluster
        self.owns_cluster = owns_cluster
        self.id = uuid.uuid4().hex
        self.started = time.time()
        self.closed = False
        self.ranks: list[RankInfo] = []
        self._router = Router()
        self.comms = errors.widget_relay(self._send_comm)  # twins of the ranks' widgets
        self._router.comms = self.comms
        self._reader = Reader(self._router)
        self._links: dict[int, Link] = {}
        self._relay = None  # started by relaying.join once many ranks share this host
        self._host_relays = {}  # host_relays.join's, one on each other host with ranks
        # What each rank last said about itself (pid, host, device): kept for a rank that stops
        # answering, and the ranks that did not answer when last asked.
        self._known: dict[int, dict[str, Any]] = {}
        self.unanswering: set[int] = set()
        self.last_failure = None  # the last failed cell's tracebacks, kept on its ranks
        self.debugging: int | None = None  # the rank a debugger is open on (dispatch/prompting.py)
        self.reloading = False  # %monarch autoreload: every cell asks its ranks to reload
        self.synced: dict[str, str] = {}  # name -> path %monarch sync sent, for new workers
        self.setup_cells: list[dict[str, str]] = []  # %%monarch --setup cells (setup_cells.py)
        self.last_profile = None  # the last profiled cell's (controller/profiling.py)
        # --ft: torchft's Lighthouse (lighthouse.py), where every rank finds it, what the ranks
        # last said of their quorum, and what happened (ft.history(); healing.py)
        self.ft = ft
        if ft is not None:
            ft.watch(lambda beacon: lighthouse.exited(self, beacon))
        self.rank_env: dict[str, str] = {} if ft is None else {"TORCHFT_LIGHTHOUSE": ft.address}
        self.ft_quorum: dict[str, Any] = {}
        self.ft_events: list[dict[str, Any]] = []
        # (time, step, participants) as the ranks report them: the panel's participants chart
        self.ft_steps: collections.deque = collections.deque(maxlen=20_000)
        self.healing_ranks: set[int] = set()  # lost ranks a fault-tolerant cell takes back
        self.rejoined: dict[int, RankInfo] = {}  # rank -> its replacement, once attached
        self._cells = itertools.count(1)
        self._notices: list[str] = []
        self._said: set[str] = set()  # notices given once per controller
        self._restarting = False
        self.restart_hooks: list = []  # called before the workers restart (the actors' state)
        # Filled by the folders above this one as they are first used, under their names
        # (actors/mesh.py): each closing hook is called with (controller, why or None) as this
        # kernel's side closes (down, detach); each owing hook with (controller, addresses)
        # says how many replies the workers there still owe, which %monarch scale waits for.
        self.closing_hooks: dict[str, Callable[[Controller, str | None], None]] = {}
        self.owing_hooks: dict[str, Callable[[Controller, set[str]], int]] = {}
        self._detached = False  # a restart was interrupted: attach to the new workers on use
        self._notices_lock = threading.Lock()
        self._loop = client.loop.asyncio_loop
        self.dist_wanted, self.dist_backend_choice = dist, backend
        self.dist_backend: str | None = None  # the process group's backend, once formed
        self.dist_error: str | None = None
        self.regroup_pending = False  # an interrupt left the group out of step (dist.py)
        self.mesh_shape = mesh  # the device mesh every rank builds over the group (mesh.py)
        self.mesh_error: str | None = None
        self._group_lock = threading.Lock()
        self._replacing = threading.Lock()  # two waiters for one lost rank's replacement
        self.setting_up: set[int] = set()  # replacements attached, not yet set up
        # A kept cluster's entry (kept.py): its host, not this kernel, started the workers.
        self.kept = kept
        self.taken: str | None = None  # why another kernel took this kept cluster (keep.py)
        group = tuple(kept["group"]) if kept else _process_group()
        self.client.register_plugin(EnginePlugin(group), name=PLUGIN_NAME)
        self.metrics = metrics.install(self.client)
        attach.attach_all(self, attach.wait_for_workers(self, expected or 1, timeout=60))
        if not (kept and adopt_group(self)):  # a kept cluster's group and mesh live on
            self._form_group()
        dashboard.install(self.client)  # /monarch pages on the scheduler's dashboard server
        registry.register(self)  # so the JupyterLab sidebar finds this cluster

    rank_table = staticmethod(attach.rank_table)

    def _form_group(self) -> None:
        with self._group_lock:  # the notebook's thread and a replacement's may both form it
            self.dist_backend = self.dist_error = None
            self.regroup_pending = False
            if not self.dist_wanted:
                return
            try:
                self.dist_backend = form_group(self, self.dist_backend_choice)
            except DistError as e:
                self.dist_error = str(e)
                return
            device_mesh.build(self)

    def _regroup_after_interrupt(self, req, outcomes: dict[int, dict]) -> None:
        """A request's outcomes, before they settle (dispatch/dispatch.py): an interrupt that
        left the ranks at different collectives has the process group formed again."""
        regroup_after_interrupt(self, req, outcomes)

    def _interrupt_cut(self, req) -> str | None:
        return interrupt_cut(self, req)

    def _send_comm(self, rank: int, msg: dict[str, Any]) -> bool:
        """A browser's message to a widget on ``rank``, on its control comm: not queued behind
        the rank's running cell. False when the rank is gone."""
        link = self._links.get(rank)
        if self.closed or link is None or not link.info.alive:
            return False
        self._loop.call_soon_threadsafe(link.control, msg)
        return True

    # -- notices: what happened to the cluster between cells ----------------------------------
    def _notice(self, text: str) -> None:
        with self._notices_lock:
            self._notices.append(text)

    def _notice_once(self, text: str) -> None:
        with self._notices_lock:
            if text not in self._said:
                self._said.add(text)
                self._notices.append(text)

    def announce(self) -> None:
        """Print the notices to stderr (the magics and run() do this before they start), sent
        at once: a kernel buffers stdout and stderr apart and sends stdout first, so a notice
        left in its buffer came after what the command printed next ("cluster shut down")."""
        texts = self.notices()
        if not texts:
            return
        sys.stdout.flush()  # what was printed before the notices stays before them
        for text in texts:
            print(f"monarch-nb: {text}", file=sys.stderr)
        sys.stderr.flush()

    def notices(self) -> list[str]:
        """What happened to the cluster since the last call (lost and replaced workers)."""
        with self._notices_lock:
            out, self._notices = self._notices, []
        return out

    def _on_loop(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def scheduler_address(self) -> str:
        return self._scheduler_address

    def _check_open(self) -> None:
        if self.closed:
            raise ClusterError(self.taken or "this cluster is down; start one with %monarch up")
        if self.client.status in ("connecting", "closing", "closed"):
            raise ClusterError(self._scheduler_gone())
        if self._detached and not self._restarting:
            print("monarch-nb: attaching to the restarted workers", file=sys.stderr)
            attach.reattach(self)

    def _scheduler_gone(self) -> str:
        return (
            f"the scheduler at {self.scheduler_address} is gone and its workers with it; "
            "use %monarch down, then %monarch up or %monarch connect"
        )

    # -- the public API -----------------------------------------------------------------------
    def run(
        self,
        code: str | syntax.ParsedCell,
        targets=None,
        block: bool = True,
        timeout: float | None = None,
        stream: bool = True,
        collapse: bool = True,
        quiet: bool = False,
        watch=None,
        setup: bool = False,
        profile=None,
    ):
        """Run ``code`` on every targeted rank (Python, with IPython's ``!cmd`` and the magics
        rank/shell.py lists); returns a ValueMesh of each rank's last expression
        (``block=False``: a CellHandle at once). ``code`` may be a cell already parsed
        (``syntax.parse``: the magic's), which is sent as it is. ``watch(request)`` is called
        once the cell is sent (the magic puts a live panel on it). ``setup``: a cell that
        defines what training needs (imports, the model, the data), run again on every rank
        that joins later, once it has run on every rank without an error. ``profile``: True,
        or a schedule (``"warmup=1,active=3"``, controller/profiling.py), runs the cell under
        torch.profiler and shows every rank's timeline under it (``last_profile``)."""
        dispatch.check_timeout(timeout)
        spec = profiling.spec_of(profile)
        if spec is not None and not block:
            raise ValueError(
                "--profile shows the ranks' timeline when the cell ends, so it cannot be --noblock"
            )
        self._check_open()
        lighthouse.renew(self)  # one that exited: said by the announce below
        self.announce()
        ranks = self.targets(targets)
        # IPython's syntax (``!cmd``, ``%time``) becomes Python here; a SyntaxError or a magic
        # the ranks lack is reported before anything is sent.
        cell = code if isinstance(code, syntax.ParsedCell) else syntax.parse(code)
        attach.wait_set_up(self, ranks)  # a replacement the cell would find without setup
        form_if_pending(self, ranks)
        if block and not quiet:
            dispatch.say_waiting(self, ranks, "this cell")
        msg = {"op": "execute", "code": cell.python, "n": next(self._cells)}
        if self.reloading:
            msg["autoreload"] = True
        if cell.python is not cell.source:
            msg["source"] = cell.source
        if setup and len(ranks) != self.world_size:
            raise ValueError("--setup cells run on every rank (they run again on ranks that join)")
        prepare = self._fault_tolerant(msg)
        profiled = None
        if spec is not None:
            profiled = profiling.Profiled(self, spec, msg["n"], ranks)
            msg["profile"] = spec
            prepare = profiling.chain(prepare, profiled.prepare)
        if not block:
            with gathering.sigint_sets() as stop:  # a Ctrl-C waits until every rank has it
                req = dispatch.submit(
                    self, "execute", ranks, msg, release=self._release(), prepare=prepare
                )
                sink = live_sink(f"[{format_ranks(ranks)}] running in the background")
                renderer = Renderer(ranks, sink=sink, collapse=collapse, stream=stream)
                handle = CellHandle(self, req, renderer, timeout)
                if watch is not None:
                    watch(req)
            if stop.is_set():  # the caller is stopped, and so is the cell it was starting
                handle.interrupt()
                raise Interrupted(
                    f"interrupted as the cell was started in the background; it was "
                    f"interrupted on {format_ranks(ranks)} too"
                )
            return handle
        # Both before the send: the first reply may come at once, and a Ctrl-C is held until
        # every rank has the cell (gathering.sigint_sets).
        with self._reader.borrow(), gathering.sigint_sets() as stop:
            req = dispatch.submit(
                self, "execute", ranks, msg, release=self._release(), prepare=prepare
            )
            renderer = Renderer(ranks, collapse=collapse, stream=stream)
            if watch is not None:
                watch(req)
            outcomes, stopped = dispatch.collect(self, req, renderer, timeout, stop)
        try:
            result = dispatch.settle(self, req, outcomes, stopped, timeout)
        finally:
            if profiled is not None:  # a failed cell's too: the others' traces are shown
                profiled.show(outcomes)
        if setup:
            setup_cells.remember(self, msg)
        return result

    def _fault_tolerant(self, msg: dict[str, Any]):
        """On a cluster started with ``--ft``: what makes a cell's request go on without a lost
        rank and take its replacement back (healing.py)."""
        if self.ft is None:
            return None
        return lambda req: healing.Healing(self, req, msg)

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s worker process, as a GPU falling off the bus would end it: for
        teaching and testing fault tolerance. Its nanny starts a replacement."""
        lifecycle.kill(self, rank)

    def _release(self) -> str | None:
        """What a cell's first failure cuts to release its other ranks (dispatch/releasing.py):
        their process groups, where the cluster has one."""
        return "group" if self.dist_backend else None

    def call(self, fn, *args, targets=None, per_rank: Mapping[int, tuple] | None = None):
        """Run ``fn(engine, *args)`` in each targeted rank's thread; a ValueMesh of the returns
        (``per_rank``: each rank's own ``args``)."""
        return dispatch.call(self, fn, args, targets, per_rank)

    def apply(self, fn, /, *args, targets=None, **kwargs) -> ValueMesh:
        """``fn(*args, **kwargs)`` on every targeted rank, in the rank's thread after the cells
        sent before it (ipyparallel's ``apply_sync``, Dask's ``client.run``); a ValueMesh of
        what it returned. ``fn`` travels by value, so a lambda or a function defined in the
        notebook works; what it prints streams back as a cell's does."""
        return data.apply(self, fn, args, kwargs, targets)

    def map(self, fn, /, *sequences, targets=None) -> list:
        """``fn`` applied to the items of ``sequences`` (zipped, as ``map`` zips them), which
        are split into contiguous chunks, one per targeted rank (ipyparallel's
        ``view.map_sync``); the results in the items' order. Like ``apply``, queued behind the
        cells sent before it. Sequences of different lengths are refused."""
        return data.map_chunks(self, fn, sequences, targets)

    def targets(self, spec=None) -> list[int]:
        return parse_targets(spec, self.world_size)

    def push(self, values: Mapping[str, Any], targets=None) -> None:
        """Copy ``values`` (name -> object) into every targeted rank's namespace."""
        data.push(self, values, targets)

    def pull(self, names: str | list[str], targets=None) -> ValueMesh:
        """The value of ``names`` (one name, or a list for tuples) on every targeted rank.

        A value that cannot be pickled on its rank, or unpickled here, fails the whole pull
        with a ValueError naming it and the ranks, as ipyparallel's pull fails: a pull that
        handed back stand-ins for some names would let ``a, b = pull(...)`` carry one into
        the notebook's code unnoticed. Pull the other names on their own."""
        return data.pull(self, names, targets)

    def scatter(self, name: str, sequence, targets=None) -> None:
        """Split ``sequence`` into contiguous chunks, one per targeted rank, in rank order."""
        data.scatter(self, name, sequence, targets)

    def gather(self, name: str, targets=None):
        """The rank values of ``name`` joined in rank order (lists, tuples, strings, tensors and
        arrays are concatenated, 0-d tensors and arrays stacked; anything else comes back as a
        list). Values that do not join (shapes, types) raise a one-line ValueError."""
        return data.gather(self, name, targets)

    def sync(self, *paths, targets=None) -> code_sync.SyncReport:
        """Send files or folders (packages) to every targeted rank, into a directory of this
        controller's first on the rank's ``sys.path`` (local to the rank's host, removed when
        the cluster goes down). Each path lands under its own name; a later sync of it sends
        only the files whose contents changed and deletes on the ranks what was deleted
        here. More than 200 MB in all (``MONARCH_NB_SYNC_LIMIT_MB``) is refused."""
        return code_sync.sync(self, list(paths), targets)

    def autoreload(self, on: bool = True) -> None:
        """``on``: before each cell, every rank reloads the modules changed since its last
        cell, as IPython's ``%autoreload 2`` does (ranks that restart do too); a module that
        fails to reload stops the cell with an error naming it and the rank."""
        self.call(rank_autoreload.enable if on else rank_autoreload.disable)
        self.reloading = on

    def interrupt(self, targets=None, wait: bool = False):
        """Raise KeyboardInterrupt in whatever cell the targeted ranks are running; returns the
        ranks. ``wait``: wait up to 1.5 s for those cells to stop and return what became of
        each rank (an ``Interruption``, whose ``str`` is ``%monarch interrupt``'s line): a cell
        stuck in a C call (a long ``time.sleep``) goes on, and its rank is named as still busy."""
        ranks = self.targets(targets)
        if wait:
            return interrupting.interrupt(self, ranks)
        dispatch.send_interrupt(self, ranks)
        return ranks

    def stacks(self, targets=None, native: bool = False) -> stacks.StacksReport:
        """Every thread's stack on the targeted ranks, identical ones grouped, and which
        collective each rank waits in (``%monarch stacks``). Answered on the ranks' event
        loops while their cells run or hang; may be called from another thread while a
        blocking cell runs. ``native``: C frames too, through py-spy where the ranks have it."""
        return stacks.ask(self, targets, native)

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, host, pid, device, state, names, labels."""
        self._check_open()
        self.announce()
        return status.rows(self)

    def rank_info(self, ranks: list[int], timeout: float = 5) -> dict[int, dict]:
        """Each rank's engine state (``Engine.info``), answered on its event loop even while
        a cell runs; a rank that does not answer within ``timeout`` is left out."""
        return dispatch.rank_info(self, ranks, timeout)

    def reset(self, targets=None) -> list[int]:
        """Clear the namespaces (the identity names are put back)."""
        ranks = self.targets(targets)
        self.call(remote.reset, targets=ranks)
        return ranks

    def restart(self) -> None:
        """Fresh worker processes with the same ranks and empty namespaces."""
        lifecycle.restart(self)

    def scale(self, n: int, wait: float | None = None) -> scale.Scaled:
        """Make the world ``n`` ranks: new ranks join with empty namespaces, the highest leave
        once what they run has ended, and the process group forms again over the new world.
        The cluster must have ``scale()`` (``up``'s, a ``--cluster`` factory's); refused while
        a cell runs. ``wait``: seconds for new workers to join (60 locally, else 600)."""
        return scale.scale(self, n, wait)

    def set_mesh(self, shape) -> device_mesh.Shape | None:
        """Have every rank build a ``torch.distributed`` DeviceMesh of ``shape`` (``{"dp": 2,
        "tp": 2}`` or ``"dp=2,tp=2"``; the sizes' product is the world size), named ``mesh`` in
        the ranks' namespaces; ``None`` drops it. Built again whenever the process group forms
        again (a replaced worker, ``scale``, which resizes the first dimension)."""
        return device_mesh.set_mesh(self, shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s place in the mesh (``{"dp": 1, "tp": 0}``); empty without a mesh."""
        return device_mesh.coordinates(self.mesh_shape, rank) if self.mesh_shape else {}

    def down(self) -> None:
        """Close the connection; a cluster this controller started is shut down with it."""
        lifecycle.down(self)

    def detach(self) -> None:
        """Let go of a kept cluster (``up(keep=...)``): it keeps running with every rank's
        namespace, process group, mesh and actors, for ``monarch_nb.attach()`` in this
        kernel or another, until its idle limit."""
        keep.detach(self)

    def __repr__(self) -> str:
        state = "down" if self.closed else f"{self.world_size} ranks"
        return f"<monarch_nb.Controller {state}>"


def _process_group() -> tuple[str, int, int]:
    """(host, process group, pid) of this process: the workers it started leave its group."""
    return socket.gethostname(), os.getpgid(0), os.getpid()
