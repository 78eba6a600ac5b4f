"""The single controller: the Dask client, the rank table, dispatch to ranks, gathering, interrupt.

``up()`` and ``connect()`` (``start.py``) make one and make it current; the magics drive the
current one, and scripts and tests can use the object directly::

    ctl = monarch_nb.up(workers=2, cpu=True)
    ctl.run("x = rank * 10")
    ctl.pull("x")            # ValueMesh({0: 0, 1: 10})
    ctl.down()
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import cloudpickle

from monarch_nb import registry
from monarch_nb.controller import gathering, syntax, unanswered
from monarch_nb.controller.dist import form_if_pending, regroup_after_interrupt
from monarch_nb.controller.handles import CellHandle
from monarch_nb.controller.links import Link, RankInfo, Reader, Request, Router
from monarch_nb.controller.names import python_name, rank_name
from monarch_nb.controller.output import Renderer, live_sink
from monarch_nb.controller.results import CellError, Interrupted, UnserializableResult, ValueMesh
from monarch_nb.controller.targets import format_ranks, parse_targets
from monarch_nb.errors import ClusterError, current, set_current
from monarch_nb.notebook.comm_relay import CommRelay
from monarch_nb.rank import remote
from monarch_nb.rank.engine import PLUGIN_NAME, EnginePlugin
from monarch_nb.telemetry import dashboard, metrics

# After an interrupt the ranks get INTERRUPT_GRACE seconds of silence to stop: a rank whose
# output is still arriving (its backlog, on a busy machine) is still heard out, up to
# INTERRUPT_FLUSH seconds in all, before it is reported as still running.
INTERRUPT_GRACE = 1.5
INTERRUPT_FLUSH = 10.0
# A rank asked at the interrupt (on its event loop, which answers while the cell runs) and
# silent this long after is not answering: stopped, or a C call holds the GIL.
ANSWER_WITHIN = INTERRUPT_GRACE + 0.25
# A rank that did not answer before gets this long to answer again (a stopped process that was
# let go on answers in milliseconds), so that status and the checks after an interrupt stay quick.
SILENT_WAIT = 0.25
SETUP_TIMEOUT = 300
REPLACE_TIMEOUT = 60  # seconds to wait for a nanny to replace a worker that died


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
    ):
        self.client = client
        # Kept: the client forgets its scheduler once it closes, and messages still name it.
        self._scheduler_address = client.scheduler.address
        self.cluster = cluster
        self.owns_cluster = owns_cluster
        self.id = uuid.uuid4().hex
        self.closed = False
        self.ranks: list[RankInfo] = []
        self._router = Router()
        self.comms = CommRelay(self._send_comm)  # twins of the ranks' widgets
        self._router.comms = self.comms
        self._reader = Reader(self._router)
        self._links: dict[int, Link] = {}
        # What each rank last said about itself (pid, host, device): kept for a rank that stops
        # answering, and the ranks that did not answer when last asked.
        self._known: dict[int, dict[str, Any]] = {}
        self.unanswering: set[int] = set()
        self._cells = itertools.count(1)
        self._notices: list[str] = []
        self._said: set[str] = set()  # notices given once per controller
        self._restarting = False
        self.restart_hooks: list = []  # called before the workers restart (the actors' state)
        self._detached = False  # a restart was interrupted: attach to the new workers on use
        self._notices_lock = threading.Lock()
        self._loop = client.loop.asyncio_loop
        self.dist_wanted, self.dist_backend_choice = dist, backend
        self.dist_backend: str | None = None  # the process group's backend, once formed
        self.dist_error: str | None = None
        self.regroup_pending = False  # an interrupt left the group out of step (dist.py)
        self._group_lock = threading.Lock()
        self.client.register_plugin(EnginePlugin(_process_group()), name=PLUGIN_NAME)
        self.metrics = metrics.install(self.client)
        self._attach(self._wait_for_workers(expected or 1, timeout=60))
        self._form_group()
        dashboard.install(self.client)  # /monarch pages on the scheduler's dashboard server
        registry.register(self)  # so the JupyterLab sidebar finds this cluster

    def _form_group(self) -> None:
        from monarch_nb.controller.dist import DistError, form_group

        with self._group_lock:  # the notebook's thread and a replacement's may both form it
            self.dist_backend = self.dist_error = None
            self.regroup_pending = False
            if not self.dist_wanted:
                return
            try:
                self.dist_backend = form_group(self, self.dist_backend_choice)
            except DistError as e:
                self.dist_error = str(e)

    # -- the rank table -----------------------------------------------------------------------
    def _wait_for_workers(self, n: int, timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while True:
            workers = self.client.scheduler_info(n_workers=-1)["workers"]
            if len(workers) >= n:
                return workers
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(workers)} of {n} workers joined within {timeout:.0f} s"
                )
            time.sleep(0.05)

    @staticmethod
    def rank_table(workers: Mapping[str, dict], previous: list[RankInfo] | None = None):
        """Ranks in a deterministic order: worker names 0..N-1 where the cluster gave them (a
        local cluster, and across restarts), else sorted by host, then address."""
        entries = [
            (addr, w.get("name", addr), w.get("host", ""), w.get("local_directory", ""))
            for addr, w in workers.items()
        ]
        names = [entry[1] for entry in entries]
        if previous:
            order = {p.name: p.rank for p in previous}
            if set(names) == set(order):
                entries.sort(key=lambda e: order[e[1]])
                return Controller._with_local_ranks(entries)
        if sorted(n for n in names if isinstance(n, int)) == list(range(len(entries))):
            entries.sort(key=lambda e: e[1])
        else:
            entries.sort(key=lambda e: (e[2], e[0]))
        return Controller._with_local_ranks(entries)

    @staticmethod
    def _with_local_ranks(entries) -> list[RankInfo]:
        per_host: dict[str, int] = {}
        table = []
        for rank, (addr, name, host, incarnation) in enumerate(entries):
            local = per_host.get(host, 0)
            per_host[host] = local + 1
            table.append(RankInfo(rank, name, addr, host, local, incarnation=incarnation))
        return table

    def _attach(self, workers: Mapping[str, dict]) -> None:
        self.ranks = self.rank_table(workers, previous=self.ranks or None)
        if not self.ranks:
            raise ClusterError("the cluster has no workers; scale it up and connect again")
        self._links = {}
        self._open_links(self.ranks)

    def _open_links(self, infos: list[RankInfo]) -> None:
        """Attach to the engines of ``infos`` and wait until each has set up its namespace."""
        links = {info.rank: Link(info, self._router, self._lost) for info in infos}
        self._links.update(links)
        setup = Request("setup", list(links))
        self._router.add(setup)

        async def open_all():
            args = self.client.connection_args
            await asyncio.gather(*(link.open(self.id, args) for link in links.values()))
            for link in links.values():
                link.reader = asyncio.ensure_future(link.read_forever())

        self._on_loop(open_all(), timeout=30)
        for link in links.values():
            self._reader.add(link)
            link.send(
                {
                    "op": "setup",
                    "id": setup.id,
                    "rank": link.info.rank,
                    "world_size": len(self.ranks),
                    "local_rank": link.info.local_rank,
                    "widgets": self.comms.shows_widgets(),
                }
            )
        outcomes = gathering.gather(
            setup, Renderer(setup.ranks), deadline=time.monotonic() + SETUP_TIMEOUT
        )
        failed = {r: ev for r, ev in outcomes.items() if ev["status"] != "ok"}
        for rank, ev in outcomes.items():
            if rank not in failed and isinstance(ev.get("info"), dict):
                self._known[rank] = ev["info"]
                self.unanswering.discard(rank)
        if failed:
            rank, ev = next(iter(failed.items()))
            raise ClusterError(f"rank {rank} failed to start its engine: {gathering.why(ev)}")

    # -- a worker that goes away --------------------------------------------------------------
    def _lost(self, rank: int, why: str) -> None:
        """On the event loop: rank's worker vanished. Wait for the nanny's replacement."""
        if self.closed or self._restarting or self._detached:
            return
        if self.client.status != "running":
            self._notice_once(self._scheduler_gone())
            return
        info = self.ranks[rank]
        self._notice(f"rank {rank} on {info.host} lost its worker ({why})")
        threading.Thread(
            target=self._replace, args=(rank,), daemon=True, name=f"monarch-replace-{rank}"
        ).start()

    def _replace(self, rank: int) -> None:
        old = self.ranks[rank]
        deadline = time.monotonic() + REPLACE_TIMEOUT
        while time.monotonic() < deadline and not self.closed and not self._restarting:
            try:
                workers = self.client.scheduler_info(n_workers=-1)["workers"]
            except Exception:
                self._notice_once(self._scheduler_gone())
                return
            for addr, w in workers.items():
                incarnation = w.get("local_directory", "")
                if w.get("name", addr) == old.name and (addr, incarnation) != (
                    old.address,
                    old.incarnation,
                ):
                    host = w.get("host", old.host)
                    info = RankInfo(
                        rank, old.name, addr, host, old.local_rank, incarnation=incarnation
                    )
                    self.ranks[rank] = info
                    try:
                        self._open_links([info])
                    except Exception as e:
                        self._notice(f"rank {rank}: its replacement could not attach: {e}")
                        return
                    self._notice(
                        f"rank {rank}: a replacement worker took its place with an "
                        "empty namespace (what the old one held is lost)"
                    )
                    self._form_group()
                    if self.dist_backend:
                        self._notice(f"the {self.dist_backend} process group was formed again")
                    return
            time.sleep(0.25)
        if not self.closed and not self._restarting:
            self._notice(
                f"rank {rank}: no replacement worker joined within "
                f"{REPLACE_TIMEOUT:.0f} s; use %monarch restart"
            )

    def _send_comm(self, rank: int, msg: dict[str, Any]) -> bool:
        """A browser's message to a widget on ``rank``, on its control comm: not queued behind
        the rank's running cell. False when the rank is gone."""
        link = self._links.get(rank)
        if self.closed or link is None or not link.info.alive:
            return False
        self._loop.call_soon_threadsafe(link.control, msg)
        return True

    def _notice(self, text: str) -> None:
        with self._notices_lock:
            self._notices.append(text)

    def _notice_once(self, text: str) -> None:
        with self._notices_lock:
            if text not in self._said:
                self._said.add(text)
                self._notices.append(text)

    def announce(self) -> None:
        """Print the notices to stderr (the magics and run() do this before they start)."""
        for text in self.notices():
            print(f"monarch-nb: {text}", file=sys.stderr)

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
            raise ClusterError("this cluster is down; start one with %monarch up")
        if self.client.status in ("connecting", "closing", "closed"):
            raise ClusterError(self._scheduler_gone())
        if self._detached and not self._restarting:
            print("monarch-nb: attaching to the restarted workers", file=sys.stderr)
            self._reattach()

    def _scheduler_gone(self) -> str:
        return (
            f"the scheduler at {self.scheduler_address} is gone and its workers with it; "
            "use %monarch down, then %monarch up or %monarch connect"
        )

    # -- dispatch and gathering ---------------------------------------------------------------
    def _submit(
        self,
        kind: str,
        ranks: list[int],
        msg: dict[str, Any] | None = None,
        per_rank: Mapping[int, dict[str, Any]] | None = None,
    ) -> Request:
        req = Request(kind, ranks)
        self._router.add(req)
        for rank in ranks:
            body = {**(msg or {}), **((per_rank or {}).get(rank, {})), "id": req.id}
            if kind == "info":  # answered on the worker's event loop, even by a busy rank
                self._loop.call_soon_threadsafe(self._links[rank].control, body)
            else:
                self._links[rank].send(body)
        return req

    def _collect(self, req: Request, renderer: Renderer, timeout: float | None = None, stop=None):
        """Gather a request; on Ctrl-C or timeout (or ``stop`` set: a background cell's
        ``handle.interrupt()``) interrupt the ranks still running."""
        outcomes: dict[int, dict] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        with gathering.sigint_sets(stop) as stop:
            try:
                gathering.gather(req, renderer, deadline, outcomes, stop)
                return outcomes, None
            except KeyboardInterrupt:
                reason = "interrupted"
            except TimeoutError:
                reason = "timeout"
            running = [r for r in req.ranks if r not in outcomes]
            self._send_interrupt(running, req.id)
            # Asked behind the interrupt on the same comm, answered on the ranks' event loops:
            # by the end of the grace below, every rank that can answer has.
            probe = self._submit("info", running, {"op": "info", "about": req.id})
            asked_at = time.monotonic()
            stop.clear()  # a second Ctrl-C stops waiting for them
            cut_short = False
            try:
                flush = time.monotonic() + INTERRUPT_FLUSH
                gathering.gather(req, renderer, flush, outcomes, stop, quiet=INTERRUPT_GRACE)
            except KeyboardInterrupt:
                cut_short = True
            except TimeoutError:
                pass
            self._cancelled_in_queue(req, outcomes, renderer, cut_short, probe, asked_at)
        return outcomes, (reason, running)

    def _cancelled_in_queue(
        self,
        req: Request,
        outcomes: dict[int, dict],
        renderer,
        cut_short: bool,
        probe: Request,
        asked_at: float,
    ) -> None:
        """A rank still silent after the interrupt may never have started ``req``: it waits
        behind an earlier cell (a ``--noblock`` one), and the interrupt told it to drop ``req``
        when it comes to it. ``probe`` asked the ranks what they run, so that those are not
        reported as stuck in a C call; a rank that did not answer it either is not answering
        at all (stopped, or the GIL held), and is reported so rather than waited for."""
        silent = [r for r in req.ranks if r not in outcomes]
        if not silent:
            return
        answers: dict[int, dict] = {}
        with contextlib.suppress(KeyboardInterrupt, TimeoutError):
            until = max(asked_at + ANSWER_WITHIN, time.monotonic())
            gathering.gather(probe, Renderer(probe.ranks), until, answers)
        about = {r: ev["info"]["about"] for r, ev in answers.items() if ev["status"] == "ok"}
        self._heard(answers)
        for rank in silent:
            if rank not in answers:
                self.unanswering.add(rank)
                outcomes[rank] = {"ev": "done", "status": "unanswered", "why": self._silence(rank)}
        for rank, state in about.items():
            if state == "cancelled" and rank in silent:
                outcomes[rank] = {
                    "ev": "done",
                    "status": "cancelled",
                    "why": "queued behind an earlier cell that is still running; "
                    "cancelled before it started",
                }
        if cut_short and {"unknown", "running"} & set(about.values()):
            # A second Ctrl-C cut the wait short: a rank that finished has its answer on the
            # way, and one still running has had the interrupt for only a moment. Up to 2 s
            # more for them, so neither is reported stuck in a C call by mistake.
            with contextlib.suppress(KeyboardInterrupt, TimeoutError):
                gathering.gather(req, renderer, time.monotonic() + 2, outcomes)

    def _heard(self, answers: Mapping[int, dict]) -> None:
        """Keep what the ranks that answered an info request said about themselves."""
        for rank, ev in answers.items():
            if ev.get("status") == "ok":
                self._known[rank] = ev["info"]
                self.unanswering.discard(rank)

    def _silence(self, rank: int) -> str:
        known = self._known.get(rank, {})
        return unanswered.why(known.get("pid"), known.get("host"))

    def _send_interrupt(self, ranks: Iterable[int], target: str | None = None) -> None:
        if self.closed:
            raise ClusterError("this cluster is down, and its cells ended with it")
        try:
            for rank in ranks:
                self._loop.call_soon_threadsafe(
                    self._links[rank].control, {"op": "interrupt", "target": target}
                )
        except RuntimeError:  # the client's event loop is closed: the client is gone
            raise ClusterError(self._scheduler_gone()) from None

    def _settle(self, req: Request, outcomes: dict[int, dict], stopped=None, timeout=None):
        """The outcomes as a ValueMesh, or the error that carries what did arrive."""
        hosts = {rank: self.ranks[rank].host for rank in req.ranks}
        ended = "shut down (%monarch down)" if self.closed else None
        if self._detached:
            ended = "restarted (%monarch restart)"
        for ev in outcomes.values():
            if ev.get("status") == "lost" and ended:
                ev["why"] = f"the cluster was {ended} while the cell ran"
                ev["ended_here"] = True
        regroup_after_interrupt(self, req, outcomes)
        try:
            return gathering.settle(req.ranks, hosts, outcomes, stopped, timeout)
        except KeyboardInterrupt:  # unpickling a large result, say: the frames are ours
            raise Interrupted(
                f"interrupted while the results of {format_ranks(req.ranks)} were unpickled "
                "here; they are not kept (keep a value in a name on the ranks and "
                "%monarch pull it)"
            ) from None

    # -- the public API -----------------------------------------------------------------------
    def run(
        self,
        code: str,
        targets=None,
        block: bool = True,
        timeout: float | None = None,
        stream: bool = True,
        collapse: bool = True,
        quiet: bool = False,
        watch=None,
    ):
        """Run ``code`` on every targeted rank (Python, with IPython's ``!cmd`` and the magics
        rank_shell.py lists); returns a ValueMesh of each rank's last
        expression (``block=False``: a CellHandle at once). ``watch(request)`` is called once
        the cell is sent (the magic puts a live panel on it)."""
        self._check_open()
        self.announce()
        ranks = self.targets(targets)
        # IPython's syntax (``!cmd``, ``%time``) becomes Python here; a SyntaxError or a magic
        # the ranks lack is reported before anything is sent.
        python = syntax.to_python(code)
        ast.parse(python, "<cell>")
        form_if_pending(self, ranks)
        if block and not quiet:
            self._say_waiting(ranks, "this cell")
        msg = {"op": "execute", "code": python, "n": next(self._cells)}
        if python is not code:
            msg["source"] = code
        req = self._submit("execute", ranks, msg)
        sink = None if block else live_sink(f"[{format_ranks(ranks)}] running in the background")
        renderer = Renderer(ranks, sink=sink, collapse=collapse, stream=stream)
        if watch is not None:
            watch(req)
        if not block:
            return CellHandle(self, req, renderer, timeout)
        outcomes, stopped = self._collect(req, renderer, timeout)
        return self._settle(req, outcomes, stopped, timeout)

    def _say_waiting(self, ranks: list[int], what: str) -> None:
        """Say so when ``what`` queues behind a cell still running on some of ``ranks``."""
        waiting = sorted(set(self._router.busy()) & set(ranks))
        if waiting:
            are, them = ("is", "it") if len(waiting) == 1 else ("are", "them")
            silent = sorted(set(waiting) & self.unanswering)
            why = "busy with an earlier cell"
            if silent:  # said by the interrupt or status that found it so
                why += f", and {format_ranks(silent)} did not answer when last asked"
            print(
                f"{format_ranks(waiting)} {are} {why}; {what} waits for "
                f"{them} (interrupt to cancel it)",
                file=sys.stderr,
            )

    def call(self, fn, *args, targets=None, per_rank: Mapping[int, tuple] | None = None):
        """Run ``fn(engine, *args)`` in each targeted rank's thread; a ValueMesh of the returns."""
        self._check_open()
        ranks = self.targets(targets)
        asked = next((what for f, what in _SAY_WAITING.items() if f is fn), None)
        if asked is not None:
            self._say_waiting(ranks, asked)
        if per_rank is not None:
            blobs = {r: {"fn": cloudpickle.dumps((fn, per_rank[r]))} for r in ranks}
            req = self._submit("call", ranks, {"op": "call"}, blobs)
        else:
            req = self._submit("call", ranks, {"op": "call", "fn": cloudpickle.dumps((fn, args))})
        outcomes, stopped = self._collect(req, Renderer(ranks))
        return self._settle(req, outcomes, stopped)

    def apply(self, fn, /, *args, targets=None, **kwargs) -> ValueMesh:
        """``fn(*args, **kwargs)`` on every targeted rank, in the rank's thread after the cells
        sent before it (ipyparallel's ``apply_sync``, Dask's ``client.run``); a ValueMesh of
        what it returned. ``fn`` travels by value, so a lambda or a function defined in the
        notebook works; what it prints streams back as a cell's does."""
        if not callable(fn):
            raise TypeError(f"apply takes a function to run on the ranks, got {type(fn).__name__}")
        try:
            blob = cloudpickle.dumps((fn, args, kwargs), protocol=5)
        except Exception as e:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise TypeError(
                f"apply: {name} or its arguments cannot be sent to the ranks: {e}"
            ) from None
        return self.call(_apply, blob, targets=targets)

    def map(self, fn, /, *sequences, targets=None) -> list:
        """``fn`` applied to the items of ``sequences`` (zipped, as ``map`` zips them), which
        are split into contiguous chunks, one per targeted rank (ipyparallel's
        ``view.map_sync``); the results in the items' order. Like ``apply``, queued behind the
        cells sent before it. Sequences of different lengths are refused."""
        if not callable(fn):
            raise TypeError(f"map takes a function to run on the ranks, got {type(fn).__name__}")
        if not sequences:
            raise TypeError("map needs at least one sequence of items for the function")
        try:
            columns = [list(seq) for seq in sequences]
        except TypeError as e:
            raise TypeError(f"map needs sequences (or other iterables): {e}") from None
        if len({len(c) for c in columns}) > 1:
            lengths = ", ".join(str(len(c)) for c in columns)
            raise ValueError(f"map: the sequences have different lengths ({lengths})")
        items = list(zip(*columns, strict=True))
        ranks = self.targets(targets)
        chunks = {}
        for rank, (start, stop) in zip(ranks, chunk_bounds(len(items), len(ranks)), strict=True):
            if start == stop:
                continue
            try:
                chunks[rank] = (cloudpickle.dumps((fn, items[start:stop]), protocol=5),)
            except Exception as e:
                name = getattr(fn, "__qualname__", type(fn).__name__)
                raise TypeError(
                    f"map: {name} or its items cannot be sent to the ranks: {e}"
                ) from None
        if not chunks:
            return []
        mesh = self.call(_map, targets=list(chunks), per_rank=chunks)
        for rank, part in mesh.items():
            if isinstance(part, UnserializableResult):
                raise ValueError(f"map: rank {rank}'s results cannot come back: {part.reason}")
        return [result for part in mesh.values() for result in part]

    def targets(self, spec=None) -> list[int]:
        return parse_targets(spec, self.world_size)

    def push(self, values: Mapping[str, Any], targets=None) -> None:
        """Copy ``values`` (name -> object) into every targeted rank's namespace."""
        payload = {}
        for raw, value in values.items():
            name = rank_name(raw, "cannot push to")
            try:
                payload[name] = cloudpickle.dumps(value, protocol=5)
            except Exception as e:
                raise ValueError(
                    f"cannot push {name!r}: {type(value).__name__} cannot be pickled ({e})"
                ) from None
        self.call(remote.push, payload, targets=targets)

    def pull(self, names: str | list[str], targets=None) -> ValueMesh:
        """The value of ``names`` (one name, or a list for tuples) on every targeted rank.

        A value that cannot be pickled on its rank, or unpickled here, fails the whole pull
        with a ValueError naming it and the ranks, as ipyparallel's pull fails: a pull that
        handed back stand-ins for some names would let ``a, b = pull(...)`` carry one into
        the notebook's code unnoticed. Pull the other names on their own."""
        many = not isinstance(names, str)
        keys = [python_name(n, "cannot pull") for n in (names if many else [names])]
        try:
            mesh = self.call(remote.pull, keys, targets=targets)
        except CellError as e:
            missing = [r for r, err in e.errors.items() if err.ename == "NameError"]
            if missing and len(missing) == len(e.errors):
                what = ", ".join(sorted({err.evalue.split("'")[1] for err in e.errors.values()}))
                raise NameError(f"{what} is not defined on {format_ranks(missing)}") from None
            raise
        rows: dict[int, list[Any]] = {}
        failed: dict[tuple[str, str], list[int]] = {}  # (name, why) -> ranks
        for rank, blobs in mesh.items():
            rows[rank] = []
            for name, blob in zip(keys, blobs, strict=True):
                if isinstance(blob, str):  # why it could not be pickled on the rank
                    failed.setdefault((name, blob), []).append(rank)
                    continue
                try:
                    rows[rank].append(cloudpickle.loads(blob))
                except Exception as e:
                    why = f"it cannot be unpickled here ({type(e).__name__}: {e})"
                    failed.setdefault((name, why), []).append(rank)
        if failed:
            (name, why), ranks = next(iter(failed.items()))
            raise ValueError(f"cannot pull {name!r} from {format_ranks(ranks)}: {why}")
        return ValueMesh({r: tuple(row) if many else row[0] for r, row in rows.items()})

    def scatter(self, name: str, sequence, targets=None) -> None:
        """Split ``sequence`` into contiguous chunks, one per targeted rank, in rank order."""
        name = rank_name(name, "cannot scatter to")
        ranks = self.targets(targets)
        try:
            n = len(sequence)
            sequence[0:0]
        except TypeError:
            raise TypeError(
                f"scatter needs a sequence with len() and slicing, got {type(sequence).__name__}"
            ) from None
        chunks = {}
        for rank, (start, stop) in zip(ranks, chunk_bounds(n, len(ranks)), strict=True):
            chunk = sequence[start:stop]
            if type(chunk).__module__.split(".")[0] == "torch":
                chunk = chunk.clone()  # a slice is a view, and a view pickles its whole storage
            try:
                chunks[rank] = ({name: cloudpickle.dumps(chunk)},)
            except Exception as e:
                raise ValueError(
                    f"cannot scatter {name!r}: its chunks cannot be pickled ({e})"
                ) from None
        self.call(remote.push, targets=ranks, per_rank=chunks)

    def gather(self, name: str, targets=None):
        """The rank values of ``name`` joined in rank order (lists, tuples, strings, tensors and
        arrays are concatenated, 0-d tensors and arrays stacked; anything else comes back as a
        list). Values that do not join (shapes, types) raise a one-line ValueError."""
        values = self.pull(name, targets).values()
        try:
            return remote.concat(values)
        except Exception as e:
            kinds = ", ".join(sorted({type(v).__name__ for v in values}))
            why = (str(e) or type(e).__name__).splitlines()[0]
            raise ValueError(
                f"cannot gather {name!r}: the ranks' values ({kinds}) do not join: {why}"
            ) from None

    def interrupt(self, targets=None) -> list[int]:
        """Raise KeyboardInterrupt in whatever cell the targeted ranks are running."""
        ranks = self.targets(targets)
        self._send_interrupt(ranks)
        return ranks

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, host, pid, device, state, names."""
        self._check_open()
        self.announce()
        alive = [i.rank for i in self.ranks if i.alive]
        outcomes = self.rank_info(alive, timeout=2)
        rows = []
        now = time.time()
        for info in self.ranks:
            ev = outcomes.get(info.rank)
            if ev is None or ev.get("status") != "ok":
                known = self._known.get(info.rank, {})
                silent = info.alive and info.rank in self.unanswering
                rows.append(
                    {
                        "rank": info.rank,
                        "host": known.get("host", info.host),
                        "pid": known.get("pid") if silent else None,
                        "device": known.get("device", {}),
                        "state": "not answering" if silent else "dead",
                        "names": None,
                    }
                )
                continue
            i = ev["info"]
            since = i["busy_since"]
            state = "idle" if since is None else f"busy {now - since:.1f} s"
            rows.append(
                {
                    "rank": info.rank,
                    "host": i["host"],
                    "pid": i["pid"],
                    "device": i["device"],
                    "state": state,
                    "names": i["names"],
                }
            )
        return rows

    def rank_info(self, ranks: list[int], timeout: float = 5) -> dict[int, dict]:
        """Each rank's engine state (``Engine.info``), answered on its event loop even while
        a cell runs; a rank that does not answer within ``timeout`` (``SILENT_WAIT`` for one
        that did not answer last time either) is left out."""
        req = self._submit("info", ranks, {"op": "info"})
        outcomes: dict[int, dict] = {}
        start = time.monotonic()
        for until in (start + min(timeout, SILENT_WAIT), start + timeout):
            with contextlib.suppress(TimeoutError):
                gathering.gather(req, Renderer(ranks), until, outcomes)
            if set(ranks) - set(outcomes) <= self.unanswering:
                break  # only ranks that did not answer before are silent: not worth the wait
        self._heard(outcomes)
        self.unanswering.update(r for r in ranks if r not in outcomes)
        return outcomes

    def reset(self, targets=None) -> list[int]:
        """Clear the namespaces (the identity names are put back)."""
        ranks = self.targets(targets)
        self.call(remote.reset, targets=ranks)
        return ranks

    def restart(self) -> None:
        """Fresh worker processes with the same ranks and empty namespaces."""
        self._check_open()
        self._restarting = True  # a replacement in progress stands down: restart attaches all
        try:
            self._close_links()
            self._detached = True
            for hook in self.restart_hooks:
                hook()
            nanny = logging.getLogger("distributed.nanny")  # in-process for a local cluster
            level = nanny.level
            nanny.setLevel(logging.ERROR)  # "Restarting worker": what was asked for
            try:
                self.client.restart(wait_for_workers=True)
            finally:
                nanny.setLevel(level)
            self._reattach()
        except KeyboardInterrupt:
            # The scheduler goes on restarting the workers; the next use attaches to them.
            raise Interrupted(
                "interrupted while the workers restart; the next cell attaches to the new ones"
            ) from None
        finally:
            self._restarting = False

    def _reattach(self) -> None:
        self._attach(self._wait_for_workers(len(self.ranks), timeout=60))
        self._detached = False
        self._form_group()

    def _close_links(self) -> None:
        async def close_all():
            await asyncio.gather(
                *(link.close() for link in self._links.values()), return_exceptions=True
            )

        with contextlib.suppress(Exception):
            self._on_loop(close_all(), timeout=5)

    def down(self) -> None:
        """Close the connection; a cluster this controller started is shut down with it."""
        if self.closed:
            return
        self.closed = True
        from monarch_nb.actors import (
            mesh as actors,  # actors build on the controller, so they are imported late
        )
        from monarch_nb.controller import cluster as clusters

        interrupted, error = False, None
        gone = clusters.scheduler_gone(self.client, self.cluster)  # closed quickly and quietly
        for step in (
            lambda: actors.close(self),
            lambda: registry.unregister(self),
            self.comms.close,
            self.metrics.close,
            self._close_links,
            self._reader.stop,
            lambda: clusters.close_client(self.client, gone),
            lambda: (
                self.owns_cluster
                and self.cluster is not None
                and clusters.close_cluster(self.cluster, gone)
            ),
        ):
            try:
                step()
            except KeyboardInterrupt:  # finish going down: a half-closed cluster helps no one
                interrupted = True
            except Exception as e:
                error = error or e
        if current() is self:
            set_current(None)
        if error is not None:
            raise error
        if interrupted:
            done = "the cluster was shut down" if self.owns_cluster else "disconnected"
            raise Interrupted(f"%monarch down was interrupted; {done} all the same")

    def __repr__(self) -> str:
        state = "down" if self.closed else f"{self.world_size} ranks"
        return f"<monarch_nb.Controller {state}>"


def _process_group() -> tuple[str, int, int]:
    """(host, process group, pid) of this process: the workers it started leave its group."""
    return socket.gethostname(), os.getpgid(0), os.getpid()


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, stop) ranges over ``n`` items, sizes differing by at most 1,
    the larger first (as ipyparallel's scatter and numpy's array_split)."""
    size, extra = divmod(n, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _apply(engine, blob: bytes):
    fn, args, kwargs = cloudpickle.loads(blob)
    return fn(*args, **kwargs)


def _map(engine, blob: bytes) -> list:
    fn, items = cloudpickle.loads(blob)
    return [fn(*item) for item in items]


# What the user asked for, by the function that does it on the ranks: said to wait behind a
# busy rank, as a cell is (calls of our own, the process group's say, stay quiet).
_SAY_WAITING = {
    remote.push: "this push",
    remote.pull: "this pull",
    _apply: "this apply",
    _map: "this map",
}
