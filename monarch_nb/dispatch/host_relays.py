"""Ranks on other hosts are reached through a relay on their host (monarch_nb/relay/host.py).

Past the controller's host every rank had a TCP connection of its own, and every reply woke the
kernel: at 128 hosts of 8 GPUs, 1,024 sockets, each read once per cell. From HOST_RELAY_FROM
ranks on a host, a worker there starts a relay (rank/host_relay.py) and the controller speaks to
the host through it on one connection: a request to many of its ranks is written once (``F``),
and what the engines write comes back batched, as many ranks' bytes in one message as reached
the relay in one turn of its loop (``E``), in order per rank; ``RelayedConn`` puts each rank's
frames back together, and the Reader (reader.py) reads one socket per host.

The relay runs no user code. Should it end anyway (killed), its ranks are reached directly from
then on: each engine kept what it sent (rank/retained.py) until the controller acknowledged it
(every ACK_BYTES or ACK_FRAMES it reads), and on the direct connection the controller says how
many frames it read (``resume``), so the engine sends again what the relay may have lost; the
cells and calls still unfinished are sent again (an engine drops a second copy). Should the
relay's connection time out instead (keep-alive probes unanswered), the host is out of reach:
its ranks are lost at once, as their direct links' would be, with no direct connection tried.

Off where the cluster uses TLS (the relay speaks plain TCP); a relay that cannot start leaves
its host's ranks on direct links, said once.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch.links import UNREACHABLE, keep_alive
from monarch_nb.dispatch.resending import Unfinished
from monarch_nb.wire import (
    HEADER,
    MAX_READ,
    FrameConn,
    MalformedMessage,
    frame,
    host_of,
    scratch_buffer,
    unframe,
)

if TYPE_CHECKING:
    from monarch_nb.dispatch.links import Link, Request, Router
    from monarch_nb.dispatch.protocol import Ctl
    from monarch_nb.dispatch.reader import Reader

HOST_RELAY_FROM = 2  # ranks on another host from which they are reached through its relay
ACK_BYTES = 1 << 20  # read from a rank before the controller says so (what its engine keeps)
ACK_FRAMES = 1024
CONNECT_WITHIN = 5.0  # seconds to reach a relay that has just said where it listens
DIRECT_WITHIN = 2.0  # seconds to reach a relay's engines directly once it has ended
IDENT = struct.Struct("!I")
NAME = struct.Struct("!H")
RECORD = struct.Struct("!QBI")  # a message up: its length, kind and ident
C = ord("C")  # a message up that says an engine's connection ended
# A rank's frame this small that repeats the one its host's relay brought before (a thousand
# ranks' {"ev": "done", "status": "ok"} for the same cell) is not unpickled again: its events
# are copied from the first's, where they hold only immutable values. Unpickling was a quarter
# of the controller's CPU at 1,024 relayed ranks (bench_fanout.py --kinds hosts).
SAME_MAX = 512
FLAT = (str, int, float, bool, bytes, type(None))


def _flat(events: Any) -> bool:
    """Whether ``events`` is a list of events (dicts) that hold only immutable values."""
    return type(events) is list and all(
        type(ev) is dict and all(type(v) in FLAT for v in ev.values()) for ev in events
    )


def _malformed(e: Exception) -> MalformedMessage:
    """What a rank's bytes that do not unpickle say of it (as wire.unframe says it)."""
    if isinstance(e, MalformedMessage):
        return e
    return MalformedMessage(f"it sent a malformed message ({type(e).__name__}: {e})")


def _message(*parts: bytes) -> tuple[bytes]:
    body = b"".join(parts)
    return (HEADER.pack(len(body)) + body,)


class RelayedConn:
    """A link's data path through its host's relay, in place of its FrameConn."""

    def __init__(self, relay: HostRelay, ident: int, link: Link):
        self.relay, self.ident, self.link = relay, ident, link
        self.rank = link.info.rank
        self.buf = bytearray()  # a frame not yet whole
        self.read = 0  # whole frames read: what the engine numbered them by
        self.acked = 0
        self.unacked = 0  # bytes read since the last acknowledgement

    def fileno(self) -> int:
        return -1  # the Reader watches the relay's connection instead

    @property
    def backlog(self) -> list[Any]:
        return []  # nothing arrives before the Reader watches the relay

    def take(self, chunk) -> list[Any]:
        """The messages ``chunk`` completes (MalformedMessage for one that does not unpickle)."""
        self.unacked += len(chunk)
        if self.buf:
            self.buf += chunk
            out, start = unframe(self.buf, len(self.buf))
            del self.buf[:start]
        else:
            out, start = unframe(chunk, len(chunk))
            if start < len(chunk):
                self.buf += chunk[start:]
        self.read += len(out)
        return out

    def post_frame(self, parts: tuple[bytes, ...]) -> None:
        """A message for this rank alone (Link.send_direct: its relay ended meanwhile)."""
        direct = self.link.conn
        if direct is self:
            raise ConnectionError("its host's relay ended and it could not be reached directly")
        direct.post_frame(parts)

    def interrupt(self, msg: dict[str, Any]) -> None:
        """Link.interrupt_here's, through the relay: its accepting thread takes it."""
        self.relay.say(self, {"interrupt": msg})

    def shutdown(self) -> None:
        self.relay.drop(self.link)

    close = shutdown


class HostRelay:
    """The controller's side of one host's relay: its connection, and the links behind it."""

    def __init__(self, host: str, port: int, token: str, router: Router, reader: Reader):
        sock = socket.create_connection((host, port), timeout=CONNECT_WITHIN)
        sock.settimeout(None)
        keep_alive(sock)
        self.host, self.router, self.reader = host, router, reader
        self.conn = FrameConn(sock)  # its post_frame never blocks the sender
        self.conn.post_frame(_message(b"T", token.encode()))
        self.alive = True
        self.pid = 0  # the relay's, on its host
        self.lock = threading.Lock()  # alive, conns, unfinished; a write keeps its order
        self.read_lock = threading.Lock()  # a feed and the delivery of what it read
        self.conns: dict[int, RelayedConn] = {}
        self._ids = itertools.count(1)
        self.buf = bytearray()
        self.unfinished = Unfinished(router)  # sent again directly if it ends
        self.same: tuple[bytes, list[dict[str, Any]]] | None = None  # (SAME_MAX) its bytes, events

    def fileno(self) -> int:
        return self.conn.fileno()

    def _events(self, raw) -> Any:
        """One whole frame's events: a copy of the last small frame's where ``raw`` repeats
        it (SAME_MAX), else unpickled."""
        same = self.same
        if same is not None and len(raw) == len(same[0]) and bytes(raw) == same[0]:
            return [ev.copy() for ev in same[1]]
        events = pickle.loads(raw)
        if len(raw) <= SAME_MAX and _flat(events):
            self.same = bytes(raw), [ev.copy() for ev in events]
        return events

    # -- membership ----------------------------------------------------------------------------
    def open(self, link: Link) -> bool:
        """The relay opens ``link``'s data path (the controller's handshake, asking the engine to
        keep what it sends); the direct one closes. False where it cannot."""
        hello = link.hello or {}
        name = hello.get("local")
        if not isinstance(name, str):
            return False
        said = {"controller": link.controller, "token": hello["token"], "retain": True}
        with self.lock:
            if not self.alive:
                return False
            ident = next(self._ids)
            conn = RelayedConn(self, ident, link)
            encoded = name.encode()
            head = b"O" + IDENT.pack(ident) + NAME.pack(len(encoded)) + encoded
            try:
                self.conn.post_frame(_message(head, *frame(said)))
            except OSError:
                return False
            self.conns[ident] = conn
            old, link.conn, link.relay = link.conn, conn, self
        if old is not None:
            old.close()
        return True

    def drop(self, link: Link) -> None:
        """``link`` is gone (its worker, its connection): what is sent to it no longer comes
        here, and the relay closes its engine connection."""
        conn = link.conn
        with self.lock:
            if link.relay is self:
                link.relay = None  # its requests end at once as lost (Link.send_direct)
            if not isinstance(conn, RelayedConn) or self.conns.pop(conn.ident, None) is None:
                return
            if self.alive:
                with contextlib.suppress(OSError):
                    self.conn.post_frame(_message(b"D", IDENT.pack(conn.ident)))

    # -- sending -------------------------------------------------------------------------------
    def forward(self, links: list[Link], msg: dict[str, Any], framed: tuple[bytes, ...]) -> bool:
        """``framed`` (``msg``) to every link's engine, written once; False once the relay has
        ended (the caller sends directly)."""
        idents = [link.conn.ident for link in links if isinstance(link.conn, RelayedConn)]
        head = struct.pack(f"!cI{len(idents)}I", b"F", len(idents), *idents)
        with self.lock:
            if not self.alive:
                return False
            try:
                self.conn.post_frame(_message(head, *framed))
            except OSError:
                return False
            self.unfinished.keep(links, msg)
        return True

    def say(self, conn: RelayedConn, what: dict[str, Any], post: bool = True) -> bytes:
        """A handshake that carries ``what`` (an interrupt, an acknowledgement) to the engine on
        a connection of its own, which its accepting thread reads however busy the rank is."""
        link = conn.link
        said = {"controller": link.controller, "token": (link.hello or {}).get("token"), **what}
        body = _message(b"H", IDENT.pack(conn.ident), *frame(said))[0]
        if post:
            with self.lock:
                if self.alive:
                    with contextlib.suppress(OSError):
                        self.conn.post_frame((body,))
        return body

    # -- reading (the Reader's thread, or the one that borrowed the links) ----------------------
    def feed(self) -> list[tuple[Link, str]] | None:
        """Route what arrived to the Router; the links whose engine connection ended, with why,
        or None once the relay's connection has (TimeoutError: its host no longer answers)."""
        scratch = scratch_buffer()
        try:
            got = self.conn.sock.recv_into(scratch, MAX_READ, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        if not got:
            return None
        buf = self.buf
        if buf:
            buf += scratch[:got]
            data, end = buf, len(buf)
        else:
            data, end = scratch, got
        ended: list[tuple[Link, str]] = []
        acks: list[RelayedConn] = []
        deliver, conns = self.router.deliver, self.conns
        start, size, head = 0, RECORD.size, HEADER.size
        while end - start >= size:
            n, kind, ident = RECORD.unpack_from(data, start)
            body, start = start + head, start + head + n
            if start > end:
                start = body - head
                break
            conn = conns.get(ident)
            if conn is None:
                continue  # dropped: its rank left
            if kind == C:
                ended.append((conn.link, bytes(data[body + 5 : start]).decode(errors="replace")))
                continue
            frame_at = body + 5
            try:
                # the usual case, a thousand times a cell at a thousand ranks: one whole frame
                if (
                    not conn.buf
                    and HEADER.unpack_from(data, frame_at)[0] == start - frame_at - head
                ):
                    conn.unacked += start - frame_at
                    conn.read += 1
                    batches = (self._events(data[frame_at + head : start]),)
                else:
                    batches = conn.take(data[frame_at:start])
            except Exception as e:  # pickle's, for bytes that are no message; MalformedMessage
                ended.append((conn.link, f"its connection closed: {_malformed(e)}"))
                continue
            rank = conn.rank
            for batch in batches:
                for ev in batch:
                    deliver(rank, ev)
            if conn.unacked >= ACK_BYTES or conn.read - conn.acked >= ACK_FRAMES:
                acks.append(conn)
        if data is buf:
            del buf[:start]
        else:
            buf += scratch[start:got]
        if acks:
            self._ack(acks)
        return ended

    def _ack(self, conns: list[RelayedConn]) -> None:
        bodies = []
        for conn in conns:
            bodies.append(self.say(conn, {"ack": conn.read}, post=False))
            conn.acked, conn.unacked = conn.read, 0
        with self.lock:
            if self.alive:
                with contextlib.suppress(OSError):
                    self.conn.post_frame((b"".join(bodies),))

    # -- its end -------------------------------------------------------------------------------
    def ended(self, unreachable: bool) -> None:
        """The relay's connection ended: its links go direct, resuming where they were read to,
        and the cells and calls unfinished on them are sent again; or, where its host no longer
        answers (``unreachable``), they are lost."""
        lost: list[tuple[Link, str]] = []
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            self.conn.close()
            conns = list(self.conns.values())
            self.conns.clear()
            direct = {} if unreachable else _connect_all(conns, DIRECT_WITHIN)
            for conn in conns:
                link = conn.link
                link.relay = None
                sock = direct.get(conn.ident)
                if sock is None:
                    why = UNREACHABLE if unreachable else "its host's relay ended, and so did it"
                    lost.append((link, why))
                    continue
                link.conn = FrameConn(sock)
                hello = link.hello or {}
                said = {"controller": link.controller, "token": hello["token"], "resume": conn.read}
                with contextlib.suppress(OSError):
                    link.conn.send(said)
                self.reader.add(link)
            self.unfinished.send_again(lambda link: isinstance(link.conn, FrameConn))
        for link, why in lost:
            link.gone(why)

    def close(self) -> None:
        """End the relay (the cluster is going down): it sees its connection end and exits."""
        with self.lock:
            self.alive = False
            self.conns.clear()
            self.conn.close()


def _connect_all(conns: list[RelayedConn], timeout: float) -> dict[int, socket.socket]:
    """A TCP connection to each conn's engine, all at once, within ``timeout`` seconds."""
    pending: dict[int, tuple[int, socket.socket]] = {}
    done: dict[int, socket.socket] = {}
    poller = select.poll()
    for conn in conns:
        link = conn.link
        host = host_of(link.info.address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        if sock.connect_ex((host, (link.hello or {}).get("port", 0))) not in (0, errno.EINPROGRESS):
            sock.close()
            continue
        pending[sock.fileno()] = (conn.ident, sock)
        poller.register(sock, select.POLLOUT)
    deadline = time.monotonic() + timeout
    while pending and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            ident, sock = pending.pop(fd)
            poller.unregister(fd)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                sock.close()
                continue
            sock.setblocking(True)
            keep_alive(sock)
            done[ident] = sock
    for _, sock in pending.values():
        sock.close()
    return done


# -- the controller's use ----------------------------------------------------------------------
def place(link: Link) -> str | None:
    """The host address of ``link``'s engine where a relay there could carry it: a rank on
    another host, reached by plain TCP, whose engine listens on a Unix-domain socket too."""
    conn = link.conn
    if isinstance(conn, RelayedConn):
        return conn.relay.host
    sock = getattr(conn, "sock", None)
    if sock is None or sock.family == socket.AF_UNIX or conn.tls:
        return None
    if not isinstance((link.hello or {}).get("local"), str):
        return None
    return host_of(link.info.address)


def join(
    ctl: Ctl,
    links: list[Link],
    start: Callable[[Link, str], dict[str, int]],
    say: Callable[[str], None],
) -> None:
    """Put ``links`` (just opened, nothing sent on them yet) behind their host's relay, started
    there with ``start(link, token)`` once HOST_RELAY_FROM ranks share a host; ``say``: what
    the user is told once, where a relay cannot start."""
    busy = {rank for req in list(ctl._router.live.values()) for rank in req.remaining}
    new = {id(link) for link in links}
    by_host: dict[str, list[Link]] = collections.defaultdict(list)
    for link in ctl._links.values():
        host = place(link)
        if host is not None and (id(link) in new or link.info.rank not in busy):
            by_host[host].append(link)
    for host, group in by_host.items():
        relay = ctl._host_relays.get(host)
        if relay is None or not relay.alive:
            if len(group) < HOST_RELAY_FROM:
                continue
            token = secrets.token_hex(16)
            try:
                where = start(group[0], token)
                relay = HostRelay(host, where["port"], token, ctl._router, ctl._reader)
                relay.pid = where["pid"]  # (on its host)
            except Exception as e:  # whatever the worker or the network said
                say(
                    f"no relay on host {host} ({type(e).__name__}: {e}); its ranks are reached "
                    "directly"
                )
                continue
            ctl._host_relays[host] = relay
        for link in group:
            if not isinstance(link.conn, RelayedConn):
                relay.open(link)


def forward(
    ctl: Ctl, req: Request, ranks: list[int], msg: dict[str, Any], framed: tuple[bytes, ...]
) -> list[int]:
    """Send ``msg`` (``framed`` once) to the ranks behind host relays, once per host; the ranks
    left for the caller to send to."""
    if not ctl._host_relays:
        return ranks
    links = ctl._links
    groups: dict[HostRelay, list[Link]] = {}
    left = []
    for rank in ranks:
        link = links.get(rank)
        relay = None if link is None else link.relay
        if isinstance(relay, HostRelay):
            groups.setdefault(relay, []).append(link)
        else:
            left.append(rank)
    for relay, through in groups.items():
        if relay.forward(through, msg, framed):
            for link in through:
                link.last_sent = req.id
        else:
            left.extend(link.info.rank for link in through)
    return left


def close(ctl: Ctl) -> None:
    for relay in ctl._host_relays.values():
        relay.close()
    ctl._host_relays.clear()
