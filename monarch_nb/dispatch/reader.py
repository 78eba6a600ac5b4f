"""Reading every rank's data path on the controller, and routing what arrives.

One thread, the Reader's, reads the ranks' sockets while nobody waits for them. A thread that
waits for a request's events (the notebook's thread in a blocking cell) borrows the sockets
instead and reads them itself while it waits: the reply then wakes the thread that wants it,
not a reader that hands it over, which on a small machine was a third of a trivial cell's trip.
The Reader's epoll stops watching the borrowed sockets and watches them again when the borrow
ends; a feed and the delivery of what it read hold the link's lock, so two threads that both
saw a socket readable keep its events in order (the second finds nothing: the sockets are read
without blocking).
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch.links import UNREACHABLE
from monarch_nb.wire import MalformedMessage

if TYPE_CHECKING:
    from monarch_nb.dispatch.host_relays import HostRelay
    from monarch_nb.dispatch.links import Link, Router

_local = threading.local()  # .reader: the Reader whose links this thread reads, if any


def next_event(events: queue.SimpleQueue, timeout: float) -> Any:
    """The next item of ``events``, waiting at most ``timeout`` seconds (queue.Empty after);
    a thread that borrowed the links reads them meanwhile, as nobody else does."""
    reader = getattr(_local, "reader", None)
    if reader is None:
        return events.get(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(queue.Empty):
            return events.get_nowait()
        left = deadline - time.monotonic()
        if left <= 0:
            raise queue.Empty
        reader._read_ready(left)


@contextlib.contextmanager
def given_back():
    """The borrowed links are the Reader's again for the block (the user answering a rank's
    prompt takes human time, while the other ranks' output goes on arriving)."""
    reader = getattr(_local, "reader", None)
    if reader is None:
        yield
        return
    _local.reader = None
    reader._watch(True)
    try:
        yield
    finally:
        reader._watch(False)
        _local.reader = reader


class Reader:
    """The controller's thread that reads every rank's data path and routes the events.

    The links' sockets sit in one epoll (``_links_ep``), which the thread's own epoll watches
    beside its wake-up socket: a borrow takes that one entry out, so lending every link costs
    two calls however many ranks there are."""

    def __init__(self, router: Router):
        self.router = router
        self._links_ep = select.epoll()
        self._links: dict[int, Link] = {}  # fd -> link, every link being read
        self._relays: dict[int, HostRelay] = {}  # fd -> the relay that links are read through
        self._ep = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._ep.register(self._links_ep.fileno(), select.EPOLLIN)
        self._added: list[Link] = []
        self._lock = threading.Lock()  # _added, _links, and the epolls' entries
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="monarch-reader", daemon=True)
        self._thread.start()

    def add(self, link: Link) -> None:
        with self._lock:
            self._added.append(link)
        self._wake_w.send(b"x")

    def stop(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    @contextlib.contextmanager
    def borrow(self):
        """The notebook's thread reads every link itself while the block runs (``next_event``
        does, while it waits). Elsewhere, or nested, the Reader goes on reading."""
        main = threading.current_thread() is threading.main_thread()
        if not main or getattr(_local, "reader", None) is not None or self._stop:
            yield
            return
        self._watch(False)
        _local.reader = self
        try:
            yield
        finally:
            _local.reader = None
            self._watch(True)  # level-triggered: what arrived meanwhile wakes the thread

    def _watch(self, on: bool) -> None:
        """Whether the Reader's thread watches the links."""
        with self._lock, contextlib.suppress(OSError, ValueError):  # ValueError: stopped
            if on:
                self._ep.register(self._links_ep.fileno(), select.EPOLLIN)
            else:
                self._ep.unregister(self._links_ep.fileno())

    def _run(self) -> None:
        wake, links = self._wake_r.fileno(), self._links_ep.fileno()
        while not self._stop:
            for fd, _ in self._ep.poll():
                if fd == wake:
                    self._take_added()
                elif fd == links:
                    self._read_ready(0)
        with self._lock:
            for link in list(self._links.values()):
                link.conn.close()
            self._links_ep.close()
            self._ep.close()
        self._wake_r.close()
        self._wake_w.close()

    def _read_ready(self, timeout: float) -> None:
        try:
            ready = self._links_ep.poll(timeout)
        except ValueError:  # the Reader stopped (the cluster went down): nothing to read
            time.sleep(min(timeout, 0.05))
            return
        links = self._links
        for fd, _ in ready:
            link = links.get(fd)
            if link is not None:
                self._read(link)
            elif fd in self._relays:
                self._read_relay(fd)

    def _take_added(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            added, self._added = self._added, []
            for link in added:
                relay = getattr(link.conn, "relay", None)  # behind its host's (host_relays.py)
                fd = link.conn.fileno() if relay is None else relay.fileno()
                if relay is not None and (fd in self._relays or fd < 0):
                    continue
                self._links_ep.register(fd, select.EPOLLIN)
                if relay is None:
                    self._links[fd] = link
                else:
                    self._relays[fd] = relay
        for link in added:
            with link.read_lock:
                for batch in link.conn.backlog:
                    self._deliver(link, batch)

    def _read(self, link: Link) -> bool:
        """Feed ``link`` and route what arrived; False once its connection has ended."""
        with link.read_lock:
            conn = link.conn
            if conn.fileno() < 0:
                return False
            why = "its connection closed"
            try:
                batches = conn.feed()
            except MalformedMessage as e:
                batches, why = None, f"its connection closed: {e}"
            except TimeoutError:  # keep-alive probes unanswered (links.KEEPALIVE)
                batches, why = None, UNREACHABLE
            except OSError:
                batches = None
            if batches is not None:
                # inlined _deliver: at 64 ranks this runs 64 times for every trivial cell
                deliver, rank = self.router.deliver, link.info.rank
                for batch in batches:
                    for ev in batch:
                        deliver(rank, ev)
                return True
        with self._lock:
            fd = next((fd for fd, known in self._links.items() if known is link), None)
            if fd is not None:
                del self._links[fd]
                with contextlib.suppress(OSError, ValueError):
                    self._links_ep.unregister(fd)
        link.conn.close()
        link.gone(why)
        return False

    def _read_relay(self, fd: int) -> None:
        """Feed a host's relay, which routes what arrived; its end sends its links direct."""
        relay = self._relays.get(fd)
        if relay is None:  # another thread saw its end first
            return
        with relay.read_lock:
            unreachable = False
            try:
                ended = None if relay.fileno() < 0 else relay.feed()
            except TimeoutError:  # keep-alive probes unanswered: the host is gone
                ended, unreachable = None, True
            except OSError:
                ended = None
        if ended is not None:
            for link, why in ended:
                link.gone(why)
            return
        with self._lock:
            if self._relays.pop(fd, None) is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._links_ep.unregister(fd)
        relay.ended(unreachable)

    def _deliver(self, link: Link, batch: list[dict[str, Any]]) -> None:
        for ev in batch:
            self.router.deliver(link.info.rank, ev)
