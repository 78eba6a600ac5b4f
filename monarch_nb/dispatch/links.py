"""Controller side of the wire: one comm per rank, straight to the worker's engine.

Requests go out on each rank's data path straight from the calling thread (through the relay,
relaying.py, where many ranks share the controller's host); events come back on
the same socket, read by the Reader (reader.py: its thread, or the notebook's thread while it
waits) and routed by request id to the Request's queue. Interrupt and info
travel on a distributed comm, so they reach a rank whose thread is busy.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.comm import CommClosedError, connect

from monarch_nb.wire import FrameConn, Writer, connect_local, frame, host_of

if TYPE_CHECKING:
    from monarch_nb.dispatch.relaying import Relay

_ids = itertools.count(1)
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds; the engine gives up on its side after 5


_PROCESS = uuid.uuid4().hex[:6]  # ids stay unique across controllers a rank has known

# A rank on a host that vanishes (powered off, its network gone) closes nothing: its data
# connection is given up on once the kernel's keep-alive probes go unanswered (idle s, then
# probes at interval s: about 4 s), or once what was sent stays unacknowledged for USER_TIMEOUT
# ms. A busy or stopped rank's kernel still answers them; Dask's own comms take 30 s.
KEEPALIVE = {"TCP_KEEPIDLE": 1, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 5000}
UNREACHABLE = "its connection timed out: its host no longer answers"  # the reason then given


def new_id(kind: str) -> str:
    """``kind-N-P``: N counts up in this process, P names it (wire.sent_after reads both)."""
    return f"{kind}-{next(_ids)}-{_PROCESS}"


@dataclass
class RankInfo:
    rank: int
    name: Any
    address: str
    host: str
    local_rank: int = 0
    alive: bool = True
    # Tells two worker processes at one address apart (a restart with fixed ports): the
    # worker's scratch directory, which Dask makes afresh for every worker process.
    incarnation: str = ""


class Request:
    """One dispatch to a set of ranks; ``events`` receives ``(rank, event)`` in arrival order."""

    def __init__(self, kind: str, ranks: list[int]):
        self.id = new_id(kind)
        self.kind = kind
        self.ranks = list(ranks)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.remaining = set(ranks)  # updated on the event loop
        self.status: dict[int, str] = {}  # rank -> "ok" / "error" / "lost" / ..., once done
        self.t0 = time.time()
        self.last_event = time.monotonic()  # the live panel offers stacks after a quiet spell
        # Events taken from ``events`` while a rank's prompt was open, to be gathered first.
        self.backlog: collections.deque = collections.deque()
        self.turns = None  # whose prompt is open (prompting.Turns), once a rank asks
        self.send = None  # send(rank, msg) on that rank's link (dispatch.submit sets it)
        self.reader = None  # the Reader (reader.py) a thread waiting for this may borrow
        # called with (rank, event) at the first rank that fails while others still run
        # (releasing.py's Release: it stops them)
        self.on_failure = None
        # A fault-tolerant cell's (controller/healing.py): called with (rank, why) when a rank's
        # worker dies, True where the request goes on without it; and with each "ft" event.
        self.on_lost = None
        self.on_ft = None
        # and with a rank's end, True where the request takes it back (a replica group's rank
        # that failed as its group lost a rank: killed, and brought back with it)
        self.on_done = None
        # A profiled cell's (controller/profiling.py): called with each rank's "profile" event
        self.on_profile = None


class Router:
    """Live requests by id; the links deliver events here from the event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self.comms = None  # the CommRelay that widgets' comm events go to (comm_relay.py)

    def add(self, request: Request) -> None:
        with self._lock:
            self._requests[request.id] = request

    @property
    def live(self) -> dict[str, Request]:
        """The unfinished requests by id (read it, don't change it)."""
        return self._requests

    def deliver(self, rank: int, ev: dict[str, Any]) -> None:
        kind = ev["ev"]
        if kind == "comm":  # a widget's, whichever cell (if any) it came in
            if self.comms is not None:
                self.comms.deliver(rank, ev)
            return
        if kind == "display" and self.comms is not None:
            self.comms.displayed(ev)  # a rank's widget: its output gets a display id
        if kind in ("ft", "profile"):
            # a rank's committed step in a fault-tolerant cell (rank/ft.py), a profiled cell's
            # trace (rank/profiling.py)
            with self._lock:
                req = self._requests.get(ev["id"])
            hook = None if req is None else req.on_ft if kind == "ft" else req.on_profile
            if hook is not None:
                hook(rank, ev)
            return
        if kind == "done":
            if self.comms is not None and self.comms.holding:
                self.comms.flush()  # the rank's widgets show their last state before its end
            with self._lock:
                req = self._requests.get(ev["id"])
                if req is not None and req.on_done is None:  # (one lock: a thousand a cell)
                    remaining = self._done(req, rank, ev)
            if req is None:
                return
            if req.on_done is not None:
                if req.on_done(rank, ev):
                    return
                with self._lock:
                    remaining = self._done(req, rank, ev)
            release = req.on_failure is not None and not ev.get("no_release")
            if remaining and release and failed(ev):
                req.on_failure(rank, ev)  # the others are still running: release them
        else:
            with self._lock:
                req = self._requests.get(ev["id"])
            if req is None:
                return
        req.last_event = time.monotonic()
        req.events.put((rank, ev))

    def _done(self, req: Request, rank: int, ev: dict[str, Any]) -> set[int]:
        """(Holding the lock.) ``rank`` ended ``req``: the ranks still running it."""
        req.status[rank] = ev["status"]
        remaining = req.remaining
        remaining.discard(rank)
        if not remaining:
            self._requests.pop(req.id, None)
        return remaining

    def lost(self, rank: int, why: str) -> None:
        """Finish every request still waiting on ``rank``: its worker is gone."""
        with self._lock:
            waiting = [r for r in self._requests.values() if rank in r.remaining]
        for req in waiting:
            if req.on_lost is not None and req.on_lost(rank, why):
                continue  # a fault-tolerant cell goes on, and takes the rank back
            self.deliver(rank, {"ev": "done", "id": req.id, "status": "lost", "why": why})
        if self.comms is not None:
            self.comms.lost(rank)

    def parked(self) -> dict[int, Request]:
        """Ranks whose pdb waits in a background cell for ``%monarch debug`` (prompting.py)."""
        with self._lock:
            requests = list(self._requests.values())
        return {r: req for req in requests if req.turns for r in list(req.turns.parked)}

    def busy(self, kind: str = "execute") -> dict[int, str]:
        """Ranks with an unfinished request of ``kind``, and that request's id."""
        with self._lock:
            return {
                rank: req.id
                for req in self._requests.values()
                if req.kind == kind
                for rank in req.remaining
            }


def failed(ev: dict[str, Any]) -> bool:
    """Whether a rank's end is a failure of its own: not an interrupt (the user's Ctrl-C, a
    timeout's) nor a release by another rank's failure."""
    if ev["status"] == "lost":
        return True
    ename = (ev.get("error") or {}).get("ename")
    return ev["status"] == "error" and ename not in ("KeyboardInterrupt", "Released")


async def _connect_data(address: str, hello: dict[str, Any]) -> socket.socket:
    """The data path's socket to the engine whose handshake said ``hello``: its Unix-domain
    listener where the engine is on this host (never waiting: this runs on the event loop),
    else TCP to its port."""
    sock = connect_local(hello, timeout=0.0)
    if sock is not None:
        return sock
    host = host_of(address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, hello["port"]))
    sock.setblocking(True)
    keep_alive(sock)
    return sock


def keep_alive(sock: socket.socket) -> None:
    """Probe a TCP data connection's peer while it is quiet (KEEPALIVE), where the system can."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Link:
    """The controller's two connections to one rank's engine: a distributed comm for control
    (interrupt, info; its closing means the worker is gone), opened on the client's event loop,
    and the data path (a FrameConn) that any thread writes requests to and the Reader reads."""

    def __init__(self, info: RankInfo, router: Router, on_lost=None):
        self.info = info
        self.router = router
        self.on_lost = on_lost  # called with (rank, why) when the worker goes away
        self.closing = False
        self.comm = None
        self.controller: str | None = None
        self.hello: dict[str, Any] | None = None  # where the engine listens, and its token
        self.writer: Writer | None = None
        self.conn: FrameConn | None = None
        self.relay: Relay | None = None  # where its requests go, while one runs (relaying.py)
        self.relay_id = 0
        self.reader: asyncio.Future | None = None
        self._gone = False
        self._lock = threading.Lock()
        self.read_lock = threading.Lock()  # a feed and the delivery of what it read
        # The newest request sent on the data path: an interrupt of "whatever runs" spares
        # requests sent after it, which its other path (the control comm) may arrive behind.
        self.last_sent = new_id("none")

    async def open(self, controller: str, connection_args: dict[str, Any]) -> None:
        """The handshake: attach over the control comm, then connect the data path."""
        self.comm = await connect(self.info.address, **connection_args)
        await self.comm.write({"op": "monarch_attach", "reply": False, "controller": controller})
        hello = await self.comm.read()
        self.controller, self.hello = controller, hello
        self.writer = Writer(self.comm)
        sock = await _connect_data(self.info.address, hello)
        ssl_context = connection_args.get("ssl_context")
        tls = self.info.address.startswith("tls://") and ssl_context is not None
        if tls and sock.family != socket.AF_UNIX:
            # On the event loop, so bounded: a stopped worker must not hold it for ever.
            sock.settimeout(TLS_HANDSHAKE_TIMEOUT)
            sock = ssl_context.wrap_socket(sock, server_hostname=None)
            sock.settimeout(None)
        self.conn = FrameConn(sock)
        self.conn.send({"controller": controller, "token": hello["token"]})

    async def read_forever(self) -> None:
        """Watch the control comm: the worker sends nothing on it, so its end is the news."""
        why = "its connection closed"
        try:
            while True:
                await self.comm.read()
        except (CommClosedError, OSError) as e:
            why = f"its connection closed ({type(e).__name__})"
        finally:
            self.gone(why)

    def gone(self, why: str) -> None:
        """The worker went away (seen on either connection); reported once."""
        with self._lock:
            if self._gone:
                return
            self._gone = True
        self.info.alive = False
        if self.relay is not None:
            self.relay.drop(self)
        self.router.lost(self.info.rank, why)
        if self.on_lost is not None and not self.closing:
            self.on_lost(self.info.rank, why)

    def send(self, msg: dict[str, Any], framed: tuple[bytes, ...] | None = None) -> None:
        """A request on the data path (any thread), through the relay while it runs;
        ``framed``: ``msg`` already pickled by ``wire.frame`` (once for every rank it goes to)."""
        relay = self.relay
        if relay is not None and relay.forward([self], msg, framed or frame(msg)):
            self.last_sent = msg.get("id", self.last_sent)
            return
        self.send_direct(msg, framed)

    def send_direct(self, msg: dict[str, Any], framed: tuple[bytes, ...] | None = None) -> None:
        """``send`` on the link's own data path."""
        try:
            if self.conn is None or self._gone:
                raise ConnectionError("not connected")
            self.conn.post_frame(framed or frame(msg))  # never blocks: see FrameConn.post
            self.last_sent = msg.get("id", self.last_sent)
        except OSError as e:
            self.router.deliver(
                self.info.rank,
                {"ev": "done", "id": msg.get("id", ""), "status": "lost", "why": str(e)},
            )

    def interrupt_here(self, msg: dict[str, Any]) -> None:
        """An interrupt straight to an engine on this host, from the calling thread, on a
        connection of its own that the worker's accepting thread reads (engine_io.py): the
        control comm's path waits for this process's event loop, which the scheduler and the
        nannies of a local cluster share, and which a machine full of busy ranks starves for
        seconds. Best effort: the same interrupt goes on the control comm too (the engine acts
        on its ``key`` once), which keeps it ahead of what is asked after it there."""
        through = getattr(self.conn, "interrupt", None)
        if through is not None:  # behind its host's relay (host_relays.py), which says it there
            through(msg)
            return
        hello = self.hello or {}
        sock = connect_local(hello, timeout=0.0)
        if sock is None:  # another host, TLS, or a listener that takes no more
            return
        try:
            sock.setblocking(False)  # a few hundred bytes into an empty socket, or nothing
            FrameConn(sock).send(
                {"controller": self.controller, "token": hello["token"], "interrupt": msg}
            )
        except OSError:
            pass
        finally:
            sock.close()

    def control(self, msg: dict[str, Any]) -> None:
        """A control message (interrupt, info); runs on the client's event loop."""
        if self.writer is None or self.comm is None or self.comm.closed():
            self.router.deliver(
                self.info.rank,
                {"ev": "done", "id": msg.get("id", ""), "status": "lost", "why": "not connected"},
            )
            return
        self.writer.send(msg)

    async def close(self) -> None:
        self.closing = True
        self.gone("the controller closed its connection")  # before a new link takes the rank
        if self.writer is not None:
            with contextlib.suppress(Exception):
                await self.writer.flush(timeout=2)
        if self.conn is not None:
            self.conn.shutdown()
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()
