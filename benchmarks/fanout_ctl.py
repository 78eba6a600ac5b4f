"""The product's controller side driving stand-in hosts (fanout_standin.py), with no Dask
scheduler: issue 52's simulation harness.

``Hosts`` starts the stand-in processes, one per simulated host. ``Controller`` is what the
dispatch folder needs of a controller (dispatch/protocol.py's ``Ctl``), wired as
controller/controller.py and controller/attach.py wire the real one: a ``Link`` per rank opened
on an event loop of its own thread (the Dask client's, in a notebook), the Reader and Router,
the local relay joined as ``attach.open_links`` joins it (dispatch/relaying.py: from
RELAY_FROM ranks whose engines are on this host) and the other hosts' relays too
(dispatch/host_relays.py, started as a worker there would start them), each rank's setup
waited for as there (setup_wait.py), and a cell run as ``Controller.run`` runs a blocking
one: ``syntax.parse``, ``dispatch.submit``, ``dispatch.collect``, ``dispatch.settle``. Left
out, as nothing here needs them: the process group, notices, replacing a lost worker, widgets,
telemetry.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from monarch_nb.controller.attach import setup_message
from monarch_nb.dispatch import dispatch, gathering, host_relays, relaying, syntax
from monarch_nb.dispatch.links import Link, RankInfo, Request, Router
from monarch_nb.dispatch.output import Renderer
from monarch_nb.dispatch.reader import Reader
from monarch_nb.dispatch.results import ValueMesh
from monarch_nb.dispatch.setup_wait import wait_for_setup
from monarch_nb.dispatch.targets import parse_targets
from monarch_nb.errors import ClusterError
from monarch_nb.relay import start as relay_start

STANDIN = Path(__file__).resolve().parent / "fanout_standin.py"
START_TIMEOUT = 60.0  # seconds for a stand-in process to listen on all its ranks


class Host:
    """One stand-in process: ``ranks`` ranks listening on ``address``. ``prefix``: what runs
    it elsewhere (``nsenter`` into a network namespace); ``tcp_only``: its ranks offer no
    Unix-domain socket, as a far host's cannot be reached by one; ``far``: they offer one that
    only its host's relay uses (a far host on this machine, at its own 127.0.0.N)."""

    def __init__(
        self,
        ranks: int,
        address: str = "127.0.0.1",
        tcp_only: bool = False,
        prefix=(),
        far: bool = False,
    ):
        self.address = address
        self.prefix = tuple(prefix)
        self.relays: list[int] = []  # the pids of the relays started on it
        cmd = [*prefix, sys.executable, str(STANDIN), "--ranks", str(ranks), "--host", address]
        if tcp_only:
            cmd.append("--tcp-only")
        if far:
            cmd.append("--far")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = _first_line(self.proc, START_TIMEOUT)
        self.pid: int = said["pid"]
        self.addresses: list[str] = said["addresses"]

    def start_relay(self, token: str) -> dict[str, int]:
        """Its host's relay (relay/start.py), in its namespace: what a worker there starts."""
        where = relay_start.spawn(self.address, token, self.prefix)
        self.relays.append(where["pid"])
        return where

    def garbage(self, index: int) -> None:
        """Its ``index``-th rank writes a malformed frame to the controller."""
        self.proc.stdin.write(f"garbage {index}\n")
        self.proc.stdin.flush()

    def heard(self, key: str) -> tuple[int, float | None]:
        """How many of its ranks interrupt ``key`` reached, and when the last first heard it."""
        self.proc.stdin.write(f"heard {key}\n")
        self.proc.stdin.flush()
        said = _first_line(self.proc, START_TIMEOUT)
        return said["ranks"], said["last"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # it exits once stdin closes
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.stdout.close()


def _first_line(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The JSON line a stand-in prints (once it listens, or when asked); RuntimeError if it
    exits first."""
    said = relay_start.json_line(proc, timeout)
    if said is None:
        raise RuntimeError(f"a stand-in did not answer within {timeout:g} s (see its stderr)")
    return said


@contextlib.contextmanager
def running(hosts: list[Host]):
    """A Controller over ``hosts``; it and they closed after, whatever happens."""
    ctl = None
    try:
        ctl = Controller(hosts)
        yield ctl
    finally:
        if ctl is not None:
            ctl.close()
        for host in hosts:
            host.close()


class Controller:
    """The dispatch folder's controller (``Ctl``) over the ranks of ``hosts``."""

    def __init__(self, hosts: list[Host]):
        self.hosts = hosts
        self.id = uuid.uuid4().hex
        self.closed = False
        self.ranks: list[RankInfo] = []
        self.unanswering: set[int] = set()
        self._known: dict[int, dict[str, Any]] = {}
        self._links: dict[int, Link] = {}
        self._relay = None
        self._host_relays = {}
        self.said: list[str] = []  # what the product would tell the user once (notices)
        self._router = Router()
        self._reader = Reader(self._router)
        self._detached = False
        self.last_failure = None  # prompting.keep_failure keeps a failed cell's here
        self.lost: list[tuple[int, str]] = []  # (rank, why) as the links reported them
        self._cells = itertools.count(1)
        # Not named monarch-*: as Dask's client loop, it is not one of the controller's own
        # threads in ranks_measure.CpuMeter
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="fanout-loop", daemon=True).start()
        try:
            self._attach(hosts)
        except BaseException:
            self.close()
            raise

    # -- attaching (attach.open_links) ---------------------------------------------------------
    def _attach(self, hosts: list[Host]) -> None:
        places = [
            (host, local, addr) for host in hosts for local, addr in enumerate(host.addresses)
        ]
        self.ranks = [
            RankInfo(rank, addr, addr, host.address, local)
            for rank, (host, local, addr) in enumerate(places)
        ]
        links = {info.rank: Link(info, self._router, self._on_lost) for info in self.ranks}
        self._links.update(links)
        setup = Request("setup", list(links))
        self._router.add(setup)

        async def open_all():
            await asyncio.gather(*(link.open(self.id, {}) for link in links.values()))
            for link in links.values():
                link.reader = asyncio.ensure_future(link.read_forever())

        self._on_loop(open_all(), timeout=60)
        relaying.join(self, list(links.values()))
        by_address = {host.address: host for host in hosts}
        start = lambda link, token: by_address[link.info.host].start_relay(token)  # noqa: E731
        host_relays.join(self, list(links.values()), start, self.said.append)
        for link in links.values():
            self._reader.add(link)
            link.send(setup_message(link.info, setup.id, len(self.ranks), False, {}))
        outcomes = wait_for_setup(
            setup,
            lambda ranks: dispatch.submit(self, "info", ranks, {"op": "info", "about": setup.id}),
        )
        failed = {r: ev for r, ev in outcomes.items() if ev["status"] != "ok"}
        if failed:
            rank, ev = next(iter(failed.items()))
            raise ClusterError(f"rank {rank} failed to set up: {gathering.why(ev)}")
        dispatch.heard(self, outcomes)

    def _on_lost(self, rank: int, why: str) -> None:
        self.lost.append((rank, why))

    def _on_loop(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- a cell (Controller.run, blocking) ------------------------------------------------------
    def run(self, code: str, targets=None, timeout: float | None = None) -> ValueMesh:
        dispatch.check_timeout(timeout)
        self._check_open()
        ranks = self.targets(targets)
        cell = syntax.parse(code)
        msg = {"op": "execute", "code": cell.python, "n": next(self._cells)}
        if cell.python is not cell.source:
            msg["source"] = cell.source
        with self._reader.borrow(), gathering.sigint_sets() as stop:
            req = dispatch.submit(self, "execute", ranks, msg)
            renderer = Renderer(ranks)
            outcomes, stopped = dispatch.collect(self, req, renderer, timeout, stop)
        return dispatch.settle(self, req, outcomes, stopped, timeout)

    @property
    def relayed(self) -> bool:
        """Whether the local relay (relaying.py) carries this controller's requests."""
        return self._relay is not None and self._relay.alive

    # -- what dispatch/protocol.py's Ctl asks for ------------------------------------------------
    def targets(self, spec=None) -> list[int]:
        return parse_targets(spec, len(self.ranks))

    def _check_open(self) -> None:
        if self.closed:
            raise ClusterError("this simulated cluster is closed")

    def _scheduler_gone(self) -> str:
        return "the harness's event loop is closed"

    def _regroup_after_interrupt(self, req, outcomes: dict[int, dict]) -> None:
        """No process group to form again."""

    def _interrupt_cut(self, req) -> str | None:
        return None

    def close(self) -> None:
        """``attach.close_links``, then the Reader and the loop."""
        if self.closed:
            return
        self.closed = True

        async def close_all():
            await asyncio.gather(
                *(link.close() for link in self._links.values()), return_exceptions=True
            )

        with contextlib.suppress(Exception):
            self._on_loop(close_all(), timeout=5)
        relaying.close(self)
        host_relays.close(self)
        self._reader.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
