"""The data path of actor messages: plain sockets (TLS where the cluster uses TLS), each end read
by a thread of its own, so a call crosses no event loop.

A caller (a ``Mailbox``) attaches over a distributed comm to the worker's
``monarch_actors_attach`` handler, which answers with where the worker's actor listeners are (a
port, and a Unix-domain socket for a caller on the same host: wire.Listeners) and a token; the
caller connects a socket, names itself with the token, and from then on writes
its messages (a list of dicts per frame) on that socket from whichever thread sends. The
worker's one actor I/O thread reads every caller's socket and hands each message to its actor's
thread, which writes the reply itself; the caller's ``Reader`` thread settles the Future. The
comm stays open and idle: its closing is the news that the other process is gone, as for the
engine's data path (rank/engine_io.py, dispatch/links.py).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_nb.wire import FrameConn, Listeners, connect_local, host_of

logger = logging.getLogger("monarch_nb.actors")

HANDSHAKE_TIMEOUT = 5.0  # seconds for a caller to name itself on a new data connection
CONNECT_TIMEOUT = 10.0  # seconds to connect (and, with TLS, shake hands); the worker gives up at 5


# -- the worker's side ---------------------------------------------------------------------------
class Channel:
    """One caller's connection to this worker; ``send`` may be called from any thread and never
    blocks (``FrameConn.post``)."""

    def __init__(self, caller: str, comm):
        self.caller = caller
        self.comm = comm  # the attach comm; its closing means the caller is gone
        self.conn: FrameConn | None = None
        self.closed = False

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed or self.conn is None:
            return
        try:
            self.conn.post([msg])
        except OSError:
            self.closed = True  # the caller went away; the I/O thread drops the connection


class ActorWire:
    """The worker's actor listener, its callers' channels, and the I/O thread that reads them:
    ``on_batch(channel, messages)`` and ``on_closed(channel)`` run on that thread."""

    def __init__(
        self,
        host: str,
        ssl_context,
        on_batch: Callable[[Channel, list[dict]], None],
        on_closed: Callable[[Channel], None],
    ):
        self.listeners = Listeners(host, ssl_context)
        self.token = secrets.token_hex(16)
        self.channels: dict[str, Channel] = {}
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._accepted: list[Channel] = []
        self._lock = threading.Lock()
        # Accepting has threads of its own: a TLS handshake never holds up the messages of the
        # callers already connected.
        self.listeners.serve(
            HANDSHAKE_TIMEOUT, self._hello, "an actor data connection", "monarch-actors-accept"
        )
        threading.Thread(target=self._run, name="monarch-actors-io", daemon=True).start()

    def new_channel(self, caller: str, comm) -> Channel:
        channel = Channel(caller, comm)
        with self._lock:
            old, self.channels[caller] = self.channels.get(caller), channel
        if old is not None:
            self.close_channel(old)
        return channel

    def close_channel(self, channel: Channel) -> None:
        channel.closed = True
        with self._lock:
            if self.channels.get(channel.caller) is channel:
                del self.channels[channel.caller]
        if channel.conn is not None:
            channel.conn.shutdown()  # the I/O thread sees the end and closes the socket

    def _hello(self, conn: FrameConn, hello: Any) -> None:
        caller = hello.get("caller") if isinstance(hello, dict) else None
        with self._lock:
            channel = self.channels.get(caller)
            valid = channel is not None and hello.get("token") == self.token
            if valid:
                channel.conn = conn
                self._accepted.append(channel)
        if not valid:
            logger.warning("monarch_nb: refused an actor data connection without a valid token")
            conn.close()
            return
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj is self._wake_r:
                    self._take_accepted()
                    continue
                channel = key.data
                try:
                    batches = channel.conn.feed()
                except OSError:
                    batches = None
                if batches is None:
                    self._sel.unregister(key.fileobj)
                    channel.conn.close()
                    self._closed(channel)
                    continue
                self._deliver(channel, batches)

    def _take_accepted(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            accepted, self._accepted = self._accepted, []
        for channel in accepted:
            self._sel.register(channel.conn, selectors.EVENT_READ, channel)
            self._deliver(channel, channel.conn.backlog)
            channel.conn.backlog.clear()
            if channel.closed:  # its caller left during the handshake
                channel.conn.shutdown()

    def _deliver(self, channel: Channel, batches: list[list[dict]]) -> None:
        for batch in batches:
            try:
                self._on_batch(channel, batch)
            except Exception:  # one bad message must not end every caller's connection
                logger.exception("monarch_nb: cannot handle an actor message")

    def _closed(self, channel: Channel) -> None:
        channel.closed = True
        try:
            self._on_closed(channel)
        except Exception:
            logger.exception("monarch_nb: cannot stop the actors of a caller that left")


def listen_host(worker) -> str:
    """The host the worker listens on: every caller that reaches the worker reaches it."""
    return host_of(worker.address)


def server_ssl_context(worker):
    """The worker's server-side TLS context where the cluster uses TLS, else None."""
    if not worker.address.startswith("tls://"):
        return None
    return worker.security.get_listen_args("worker").get("ssl_context")


# -- the caller's side ---------------------------------------------------------------------------
def connect(address: str, hello: dict, caller: str, connection_args: dict) -> FrameConn:
    """The data connection to the worker at ``address`` whose attach answered ``hello``
    (blocking, bounded: run it off the event loop)."""
    sock = connect_local(hello, CONNECT_TIMEOUT)  # a worker on this host: wire.Listeners
    if sock is None:
        sock = socket.create_connection((host_of(address), hello["port"]), timeout=CONNECT_TIMEOUT)
    try:
        ssl_context = connection_args.get("ssl_context")
        tls = address.startswith("tls://") and ssl_context is not None
        if tls and sock.family != socket.AF_UNIX:
            sock = ssl_context.wrap_socket(sock, server_hostname=None)
        sock.settimeout(None)
        conn = FrameConn(sock)
        conn.send({"caller": caller, "token": hello["token"]})
    except BaseException:
        sock.close()
        raise
    return conn


class Reader:
    """The thread that reads one Mailbox's data connections. ``on_batch(key, messages)``,
    ``on_end(key, cause)`` and ``on_tick()`` run on it; ``key`` is what ``add`` was given with
    the connection, ``cause`` what ``end`` was, or None where the connection ended by itself."""

    def __init__(
        self,
        on_batch: Callable[[Any, list], None],
        on_end: Callable[[Any, str | None], None],
        on_tick: Callable[[], None],
    ):
        self._on_batch = on_batch
        self._on_end = on_end
        self._on_tick = on_tick
        self._tick_at: float | None = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._orders: list[tuple] = []
        self._live: set[FrameConn] = set()  # registered and not yet closed
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="monarch-mailbox", daemon=True)
        self._thread.start()

    def add(self, key: Any, conn: FrameConn) -> None:
        self._order(("add", key, conn))

    def end(self, key: Any, conn: FrameConn, cause: str) -> None:
        """Read what ``conn`` has already received, then close it and report ``cause``: a reply
        sent just before its worker died still settles its call."""
        self._order(("end", key, conn, cause))

    def tick(self, delay: float) -> None:
        """Call ``on_tick()`` in ``delay`` seconds (or sooner, if one is due already)."""
        self._order(("tick", delay))

    def stop(self) -> None:
        self._stop = True
        self._order(("stop",))

    def _order(self, order: tuple) -> None:
        with self._lock:
            self._orders.append(order)
        with contextlib.suppress(OSError):  # stopped
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop:
            wait = None if self._tick_at is None else max(0.0, self._tick_at - time.monotonic())
            for key, _ in self._sel.select(wait):
                if key.fileobj is self._wake_r:
                    self._obey()
                    continue
                conn = key.fileobj
                if conn not in self._live:  # ended by an order taken in this same round
                    continue
                try:
                    batches = conn.feed()
                except OSError:
                    batches = None
                if batches is None:
                    self._drop(conn)
                    self._report(self._on_end, key.data, None)
                    continue
                for batch in batches:
                    self._report(self._on_batch, key.data, batch)
            if self._tick_at is not None and time.monotonic() >= self._tick_at:
                self._tick_at = None
                self._report(self._on_tick)
        for key in list(self._sel.get_map().values()):
            if key.fileobj is not self._wake_r:
                key.fileobj.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _obey(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            orders, self._orders = self._orders, []
        for order in orders:
            if order[0] == "tick":
                due = time.monotonic() + order[1]
                self._tick_at = due if self._tick_at is None else min(self._tick_at, due)
            elif order[0] == "add":
                self._sel.register(order[2], selectors.EVENT_READ, order[1])
                self._live.add(order[2])
            elif order[0] == "end":
                _, key, conn, cause = order
                if conn in self._live:
                    self._read_what_came(key, conn)
                    self._drop(conn)
                else:
                    conn.close()
                self._report(self._on_end, key, cause)

    def _read_what_came(self, key: Any, conn: FrameConn) -> None:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        while poller.poll(0):
            try:
                batches = conn.feed()
            except OSError:
                return
            if batches is None:
                return
            for batch in batches:
                self._report(self._on_batch, key, batch)

    def _drop(self, conn: FrameConn) -> None:
        if conn in self._live:
            self._live.discard(conn)
            self._sel.unregister(conn)
        conn.close()

    @staticmethod
    def _report(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # the reader must live on for the other connections
            logger.exception("monarch_nb: cannot handle an actor reply")
