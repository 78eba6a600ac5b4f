"""Worker side of the wire: how requests reach a rank's thread, and how its events leave.

Control (the handshake, interrupt, info) arrives over a distributed comm on the worker's event
loop (the ``monarch_attach`` handler in engine.py). Data — cells, calls and every event back —
travels over a plain socket (TLS where the cluster uses TLS) that the rank's own thread reads
itself, so a request costs no hop through the event loop: the engine listens on the worker's
host on a port the OS picks, and for a controller on the same host on a Unix-domain socket
(wire.Listeners); a controller learns where, and a token, in the handshake.
What a cell prints is flushed by a small thread of its own, a few milliseconds after it is
written; a reply goes out at once, after everything the cell printed before it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import selectors
import socket
import threading
import time
from typing import Any

from monarch_nb.rank.capture import Outbox
from monarch_nb.rank.retained import Retained
from monarch_nb.wire import RESENT_OPS, FrameConn, Listeners, frame

logger = logging.getLogger("monarch_nb")

FLUSH_DELAY = 0.005  # seconds of output gathered into one message
PROGRESS_RECHECK = 0.05  # seconds before a throttled progress line is looked at again
HANDSHAKE_TIMEOUT = 5.0
TAKEN = 256  # cells and calls remembered to tell a second copy by


class Channel:
    """One controller's connection to this engine."""

    def __init__(self, wire: Wire, controller: str, comm):
        self.controller = controller
        self.comm = comm  # the control comm; its closing means the controller is gone
        self.conn: FrameConn | None = None
        self.outbox = Outbox(lambda urgent: wire.poke())
        self.closed = False
        self.lock = threading.Lock()  # keeps frames whole, and whole across a resume
        # Behind a host relay: the frames sent, until the controller says it read them
        # (retained.py); ``broken``: the relay's connection ended, a resume is awaited
        self.retained: Retained | None = None
        self.broken = False
        # (op, id) of the cells and calls taken lately: a copy sent again after the relay
        # ended (dispatch/relaying.py) is dropped, whichever of the two arrives first
        self._taken: collections.deque[tuple[str, str]] = collections.deque(maxlen=TAKEN)
        self._taken_set: set[tuple[str, str]] = set()

    def fresh(self, msg: dict[str, Any]) -> bool:
        """Whether ``msg`` is new to this engine (not a second copy of a cell or call)."""
        op = msg.get("op")
        if op not in RESENT_OPS:
            return True
        key = (op, msg.get("id", ""))
        if key in self._taken_set:
            return False
        if len(self._taken) == TAKEN:
            self._taken_set.discard(self._taken[0])
        self._taken.append(key)
        self._taken_set.add(key)
        return True

    def flush(self) -> bool:
        """Send the queued output; True when a throttled progress line waits."""
        if self.conn is None or self.closed:
            return False
        with self.lock:
            events, again = self.outbox.drain()
            if events:
                self._send_locked(events)
        return again

    def reply(self, event: dict[str, Any]) -> None:
        """Send ``event`` now, after every event queued before it."""
        if self.conn is None or self.closed:
            return
        with self.lock:
            events, _ = self.outbox.drain()
            self._send_locked([*events, event])

    def _send_locked(self, events: list[dict[str, Any]]) -> None:
        retained = self.retained
        if retained is None:
            try:
                self.conn.send_locked(events)
            except OSError:
                self.closed = True  # the controller went away; the reading thread drops us
            return
        data = b"".join(frame(events))
        retained.keep(data)
        if self.broken:
            return  # kept for the controller's resume
        try:
            self.conn.sock.sendall(data)
        except OSError:
            self.broken = True  # the relay ended: the controller resumes directly

    def attach(self, conn: FrameConn, retain: bool) -> None:
        """``conn`` is the controller's data connection from now on (its own, or one its host
        relay made for it: then what is sent is kept until acknowledged)."""
        with self.lock:
            self.conn, self.closed, self.broken = conn, False, False
            self.retained = Retained() if retain else None

    def resume(self, conn: FrameConn, n: int) -> bool:
        """The controller connected directly after its relay ended, having read ``n`` frames:
        the ones after are sent again, first; False where they are no longer all here."""
        with self.lock:
            frames = None if self.retained is None else self.retained.after(n)
            if frames is None:
                return False
            try:
                conn.sock.sendall(b"".join(frames))
            except OSError:
                return False
            self.conn, self.closed, self.broken, self.retained = conn, False, False, None
            return True

    def ended(self, conn: FrameConn) -> None:
        """(The rank's thread.) ``conn`` closed: the controller's channel ends with its own
        connection, except behind a relay, where the controller resumes directly."""
        if conn is not self.conn:
            return  # a relay's request connection, or one replaced
        if self.retained is not None:
            self.broken = True
        else:
            self.closed = True


class Wire:
    """The engine's listening socket, its channels, the selector that the rank's thread polls
    for requests, and the output flusher."""

    def __init__(self, host: str, ssl_context=None):
        self.listeners = Listeners(host, ssl_context)
        self.host = host
        self.token = secrets.token_hex(16)
        self.channels: dict[str, Channel] = {}
        self.inbox: collections.deque[tuple[Channel, dict[str, Any]]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        # connected (a channel's own or a relay's connection), for the rank's thread to read
        self._accepted: list[tuple[FrameConn, Channel]] = []
        self._lock = threading.Lock()
        self._poke = threading.Event()
        self.on_interrupt = None  # the engine's interrupt, for a hello that carries one
        threading.Thread(target=self._flusher, name="monarch-flush", daemon=True).start()
        # Accepting has threads of its own so that a busy rank still completes handshakes
        # (and answers info at once); its requests wait in the socket until the rank is free.
        self.listeners.serve(HANDSHAKE_TIMEOUT, self._hello, "a data connection", "monarch-accept")

    # -- the event loop -----------------------------------------------------------------------
    def new_channel(self, controller: str, comm) -> Channel:
        old = self.channels.pop(controller, None)
        if old is not None:
            self.close_channel(old)
        channel = self.channels[controller] = Channel(self, controller, comm)
        return channel

    def close_channel(self, channel: Channel) -> None:
        channel.closed = True
        if self.channels.get(channel.controller) is channel:
            del self.channels[channel.controller]
        if channel.conn is not None:
            channel.conn.shutdown()  # the rank's thread sees the end and closes the socket

    # -- the rank's thread --------------------------------------------------------------------
    def next_request(self) -> tuple[Channel, dict[str, Any]]:
        while not self.inbox:
            self.poll()
        return self.inbox.popleft()

    def take(self, match) -> tuple[Channel, dict[str, Any]] | None:
        """The first request that ``match(channel, msg)`` accepts, taken out of the inbox; the
        others stay, in order (a cell's input() waits for its answer this way)."""
        for i, (channel, msg) in enumerate(self.inbox):
            if match(channel, msg):
                del self.inbox[i]
                return channel, msg
        return None

    def poll(self, timeout: float | None = None) -> None:
        for key, _ in self._sel.select(timeout):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                with self._lock:
                    accepted, self._accepted = self._accepted, []
                for conn, channel in accepted:
                    self._sel.register(conn, selectors.EVENT_READ, channel)
                    self._take(channel, conn.backlog)
            else:
                channel, conn = key.data, key.fileobj
                try:
                    msgs = conn.feed()
                except OSError:
                    msgs = None
                if msgs is None:
                    self._sel.unregister(conn)
                    conn.close()
                    channel.ended(conn)
                else:
                    self._take(channel, msgs)

    def _take(self, channel: Channel, msgs) -> None:
        fresh = channel.fresh
        self.inbox.extend((channel, m) for m in msgs if fresh(m))

    def _hello(self, conn: FrameConn, hello: Any) -> None:
        channel = self.channels.get(hello.get("controller")) if isinstance(hello, dict) else None
        if channel is None or hello.get("token") != self.token:
            logger.warning("monarch_nb: refused a data connection without a valid token")
            conn.close()
            return
        if isinstance(hello.get("interrupt"), dict) and self.on_interrupt is not None:
            # Ctrl-C on a connection of its own, handled on this accepting thread: the control
            # comm's path runs through the notebook's event loop and this worker's, which 64
            # busy ranks on 2 cores starve for seconds (docs/measurements.md)
            conn.close()
            self.on_interrupt(hello["interrupt"])
            return
        if "ack" in hello:  # from behind the host relay: what the controller has read
            conn.close()
            if channel.retained is not None:
                channel.retained.acked(int(hello["ack"]))
            return
        if "resume" in hello:  # the host relay ended: the controller is here directly
            if not channel.resume(conn, int(hello["resume"])):
                logger.warning("monarch_nb: cannot resume: output sent meanwhile was given up")
                conn.close()
                return
        elif not hello.get("relay"):  # the controller's own connection: the replies go there
            channel.attach(conn, retain=bool(hello.get("retain")))
        with self._lock:
            self._accepted.append((conn, channel))
        self._wake_w.send(b"x")

    # -- the flusher --------------------------------------------------------------------------
    def poke(self) -> None:
        self._poke.set()

    def _flusher(self) -> None:
        while True:
            self._poke.wait()
            time.sleep(FLUSH_DELAY)  # let a burst of prints become one message
            self._poke.clear()
            again = False
            for channel in list(self.channels.values()):
                again |= channel.flush()
            if again:
                time.sleep(PROGRESS_RECHECK)
                self._poke.set()
