"""The caller's side of actor messages: one ``Mailbox`` per process that sends (the controller,
and each worker whose actors call others).

It keeps one connection per worker address, opened on first use and kept (transport.py): an
attach comm, whose closing is the signal that the worker process is gone, and a data socket that
the sending thread writes to itself and the mailbox's reader thread reads replies from. Messages
to one address go out in the order they were sent, which is what keeps one caller's messages to
one actor in order. Once a worker is gone, every call still waiting on it fails with
``SupervisionError`` and every later message to that address fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections import Counter
from typing import Any

from distributed.comm import CommClosedError, connect

from monarch_nb.actors import transport
from monarch_nb.wire import FrameConn, SigintHold

ATTACH = "monarch_actors_attach"
logger = logging.getLogger("monarch_nb.actors")
# Seconds to reach a worker before calling it dead: a refused connection is retried until then
# (a worker process that was killed refuses at once, forever).
CONNECT_TIMEOUT = 5
# Broadcasts wait this long (seconds) to go out together, or until this many wait, or until
# a call to the same worker goes (ahead of it). A write per broadcast on loopback wakes the
# worker's threads once per message, which on a busy machine made 1,000 broadcasts 3-4x slower.
CORK_DELAY = 0.0005
CORK_MAX = 512


class Pending:
    """One message sent to some ranks; ``on_reply(rank, reply)`` and ``on_lost(rank, error)``
    run on the mailbox's reader thread (or the thread that learns of a death); ``targets`` maps
    each rank still owed a reply to its address, ``keys`` each such rank to the actor it runs
    on, ``(mesh id, position)``, which ``Mailbox.inflight`` counts for choose()."""

    def __init__(self, targets: dict[int, str], on_reply, on_lost, keys=None):
        self.id = uuid.uuid4().hex
        self.targets = dict(targets)
        self.on_reply = on_reply
        self.on_lost = on_lost
        self.keys: dict[int, tuple[str, int]] = dict(keys or {})


class _Conn:
    def __init__(self, address: str, data=None):
        self.address = address
        self.comm = None  # the attach comm
        self.data: FrameConn | None = data  # given at once for this process's own actors
        self.local = data is not None
        self.backlog: list[dict] = []  # sent before the data connection was up
        self.corked: list[dict] = []  # broadcasts waiting to go out together


def _fits(conn: _Conn, batch: list[dict]) -> bool:
    """Whether ``batch`` of broadcasts may wait in ``conn``'s cork."""
    return len(conn.corked) + len(batch) < CORK_MAX


class _Direct:
    """A data connection within this process: a posted batch is delivered where it is sent."""

    def __init__(self, deliver):
        self.post = deliver

    def shutdown(self) -> None:
        pass


class Mailbox:
    """Sends actor messages from this process. ``loop`` is where the attach comms live (the
    client's or the worker's event loop); every method may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connection_args: dict, on_unsolicited):
        self.loop = loop
        self.connection_args = connection_args
        self.id = uuid.uuid4().hex
        self.on_unsolicited = on_unsolicited  # broadcast errors that are reported to us
        self.dead: dict[str, str] = {}  # address -> cause
        self.workers: dict[str, str] = {}  # address -> incarnation of the process there now
        self.ended: dict[str, str] = {}  # incarnation -> cause, for processes since replaced
        # (mesh id, position) -> messages sent to that actor and not yet answered; no zeros
        self.inflight: Counter = Counter()
        self.meshes: dict[str, Any] = {}  # actor meshes spawned from here, by id
        # (address, cause) -> None, once per process that died: supervision's (caller.py)
        self.death_watchers: list = []
        self.closed = False
        self.close_cause = ""
        self._conns: dict[str, _Conn] = {}
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._reader: transport.Reader | None = None  # started with the first connection
        self._corked: set[_Conn] = set()  # connections with broadcasts waiting

    def send(self, msgs: list[tuple[str, dict]], pending: Pending | None = None) -> None:
        """Send each ``(address, message)`` in order; ``pending`` collects the replies. The
        messages to one address go in one frame, written by this thread. A Ctrl-C meanwhile
        is raised once every address has its messages."""
        hold = SigintHold()
        try:
            self._send(msgs, pending, hold)
        finally:
            hold.release()

    def _send(self, msgs: list[tuple[str, dict]], pending: Pending | None, hold) -> None:
        if pending is not None:
            hold.arm()  # before the replies are owed
            msgs = [(a, {**m, "id": pending.id}) for a, m in msgs]
        batches: dict[str, list[dict]] = {}
        for address, msg in msgs:
            batches.setdefault(address, []).append(msg)
        refused = []
        tick = False
        with self._lock:
            if pending is not None:
                self._pending[pending.id] = pending
                self.inflight.update(pending.keys.values())
            for address, batch in batches.items():
                if address in self.dead or self.closed:
                    refused.append((address, batch, self.dead.get(address, self.close_cause)))
                    continue
                conn = self._conns.get(address)
                if conn is None:
                    conn = _Conn(address)
                    try:
                        asyncio.run_coroutine_threadsafe(self._serve(conn), self.loop)
                    except RuntimeError:  # the loop has closed: its process is going away
                        refused.append((address, batch, "its event loop has closed"))
                        continue
                    self._conns[address] = conn
                if conn.data is None:
                    conn.backlog.extend(batch)
                elif (
                    pending is None and not conn.local and len(conn.corked) + len(batch) < CORK_MAX
                ):
                    tick |= not self._corked
                    self._corked.add(conn)
                    conn.corked.extend(batch)
                else:
                    hold.arm()  # a broadcast's cork is full: written here, to each actor
                    self._post(conn, batch)
            reader = self._reader if tick else None
        if reader is not None:
            reader.tick(CORK_DELAY)
        for address, batch, cause in refused:
            for msg in batch:
                self._fail_one(address, msg.get("id"), cause)

    def _post(self, conn: _Conn, batch: list[dict]) -> None:
        """Write ``batch`` after the broadcasts waiting for ``conn`` (called with the lock held).
        Never blocks (see FrameConn.post); a connection that broke is the reader's news: it
        sees the end and fails what is owed."""
        if conn.corked:
            batch, conn.corked = conn.corked + batch, []
            self._corked.discard(conn)
        if batch:
            with contextlib.suppress(OSError):
                conn.data.post(batch)

    def add_local(self, address: str, deliver) -> None:
        """Messages to ``address`` are this process's own actors' (``this_proc()``): each batch
        goes to ``deliver(batch)`` on the sending thread, with no socket between."""
        with self._lock:
            self._conns[address] = _Conn(address, _Direct(deliver))

    def deliver(self, batch: list[dict]) -> None:
        """Replies and reports from this process's own actors, as the reader thread hands on
        what arrives from a worker."""
        self._on_batch(None, batch)

    def cause_of(self, address: str, incarnation: str = "") -> str | None:
        """Why the worker process at ``address`` (the one ``incarnation`` names, where given)
        is gone; None while it lives."""
        if incarnation in self.ended:
            return self.ended[incarnation]
        return self.dead.get(address)

    def know_workers(self, workers: dict[str, str]) -> None:
        """The worker processes now at these addresses (address -> incarnation). A new process
        at the address of a dead one (a restart with fixed ports) is alive, while actors on
        the old one stay dead for the reason it died."""
        replaced = []
        with self._lock:
            for address, incarnation in workers.items():
                previous = self.workers.get(address)
                self.workers[address] = incarnation
                if previous not in (None, "", incarnation) and incarnation:
                    replaced.append((address, previous))
        for address, previous in replaced:
            self._on_dead(address, "its worker process was replaced")  # or why it died
            with self._lock:
                self.ended[previous] = self.dead.pop(address, "its worker process was replaced")

    def mark_dead(self, address: str, cause: str) -> None:
        """Another signal (the scheduler removed the worker) that ``address`` is gone."""
        self._on_dead(address, cause)

    def close(self, cause: str = "the cluster was shut down") -> None:
        """Fail every pending call with ``cause`` (and every later one)."""
        with self._lock:
            self.close_cause = cause
            self.closed = True
            for conn in list(self._corked):  # broadcasts sent before the close still go
                self._post(conn, [])
            conns = list(self._conns.values())
            self._conns.clear()
            left = list(self._pending.values())
            reader, self._reader = self._reader, None
        for conn in conns:
            self._drop(conn)
        for pending in left:
            for rank, address in list(pending.targets.items()):
                self._fail_one(address, pending.id, cause, rank)
        if reader is not None:
            reader.stop()

    # -- the attach comm, on the loop -------------------------------------------------------------
    async def _serve(self, conn: _Conn) -> None:
        cause = "the worker process is gone (its connection closed)"
        try:
            conn.comm = await connect(conn.address, timeout=CONNECT_TIMEOUT, **self.connection_args)
            await conn.comm.write({"op": ATTACH, "reply": False, "caller": self.id})
            hello = await conn.comm.read()
            data = await asyncio.to_thread(
                transport.connect, conn.address, hello, self.id, self.connection_args
            )
            if not self._ready(conn, data):
                return
            while True:  # the worker sends nothing here: the comm's end is the news
                await conn.comm.read()
        except (CommClosedError, OSError) as e:
            if conn.comm is None:
                cause = f"the worker process cannot be reached ({e})"
            elif conn.data is None and not isinstance(e, CommClosedError):
                cause = f"the worker's actor listener cannot be reached ({e})"
            else:
                cause = f"the worker process is gone (its connection closed: {type(e).__name__})"
        except Exception as e:  # a worker without the actor plugin answers something else
            cause = f"the worker process cannot be reached ({type(e).__name__}: {e})"
        finally:
            if conn.comm is not None:
                conn.comm.abort()
            self._gone(conn, cause)

    def _ready(self, conn: _Conn, data: FrameConn) -> bool:
        """The data connection is up: send what waited for it, then let senders write."""
        with self._lock:
            if self.closed or self._conns.get(conn.address) is not conn:  # dead meanwhile
                data.close()
                return False
            if self._reader is None:
                self._reader = transport.Reader(self._on_batch, self._on_end, self._uncork)
            self._reader.add(conn, data)
            conn.data = data
            backlog, conn.backlog = conn.backlog, []
            if backlog:
                with contextlib.suppress(OSError):  # the reader sees the end
                    data.post(backlog)
        return True

    def _gone(self, conn: _Conn, cause: str) -> None:
        """The attach comm ended: the worker is gone, once the replies it sent before are in."""
        reader = self._reader
        if conn.data is not None and reader is not None:
            reader.end(conn, conn.data, cause)  # then _on_end, on the reader's thread
        else:
            self._on_end(conn, cause)

    # -- the reader's thread ----------------------------------------------------------------------
    def _on_batch(self, conn: _Conn, batch: list[dict]) -> None:
        for msg in batch:
            self._on_message(msg)

    def _uncork(self) -> None:
        with self._lock:
            for conn in list(self._corked):
                if conn.data is not None:
                    self._post(conn, [])
            self._corked.clear()

    def _on_end(self, conn: _Conn, cause: str | None) -> None:
        if cause is None:  # the data socket's end, seen before the comm's
            cause = "the worker process is gone (its connection closed)"
        if not self.closed:
            self._on_dead(conn.address, cause, only=conn)

    def _on_message(self, msg: dict) -> None:
        if "id" not in msg:
            self.on_unsolicited(msg)
            return
        with self._lock:
            pending = self._pending.get(msg["id"])
            if pending is None or msg["r"] not in pending.targets:
                return
            self._settle(pending, msg["r"])
        pending.on_reply(msg["r"], msg)

    # -- any thread -------------------------------------------------------------------------------
    def _settle(self, pending: Pending, rank: int) -> None:
        """``rank`` owes ``pending`` nothing more (called with the lock held)."""
        del pending.targets[rank]
        key = pending.keys.pop(rank, None)
        if key is not None:
            self.inflight[key] -= 1
            if self.inflight[key] <= 0:
                del self.inflight[key]
        if not pending.targets:
            del self._pending[pending.id]

    def _on_dead(self, address: str, cause: str, only: _Conn | None = None) -> None:
        """``address`` is gone (``only``: if that connection is still the one to it)."""
        with self._lock:
            conn = self._conns.get(address)
            if only is not None and conn is not only:
                return  # taken away already (the address may have a new worker process)
            first = address not in self.dead
            cause = self.dead.setdefault(address, cause)
            self._conns.pop(address, None)
            self._corked.discard(conn)
            backlog = conn.backlog if conn is not None else []
            hit = [p for p in self._pending.values() if address in p.targets.values()]
        self._drop(conn)
        for msg in backlog:
            self._fail_one(address, msg.get("id"), cause)
        for pending in hit:
            for rank in [r for r, a in list(pending.targets.items()) if a == address]:
                self._fail_one(address, pending.id, cause, rank)
        for watch in list(self.death_watchers) if first and not self.closed else []:
            try:
                watch(address, cause)
            except Exception:  # a watcher's mistake must not stop the others
                logger.exception("monarch_nb: a watcher of worker deaths failed")

    def _drop(self, conn: _Conn | None) -> None:
        if conn is None:
            return
        if conn.comm is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed, and the comm with it
                self.loop.call_soon_threadsafe(conn.comm.abort)
        if conn.data is not None:
            conn.data.shutdown()  # the reader sees the end and closes the socket

    def _fail_one(self, address: str, pid: str | None, cause: str, rank: int | None = None):
        with self._lock:
            pending = self._pending.get(pid) if pid else None
            if pending is None:
                return
            ranks = (
                [rank]
                if rank is not None
                else [r for r, a in pending.targets.items() if a == address]
            )
            ranks = [r for r in ranks if r in pending.targets]
            for r in ranks:
                self._settle(pending, r)
        for r in ranks:
            pending.on_lost(r, address, cause)
