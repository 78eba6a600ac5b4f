"""Requests to many ranks on this host go through the relay (monarch_nb/relay/main.py).

Sending a request to a rank's engine costs the notebook's process a socket write that wakes
the engine: about 7 us a rank on a small machine (docs/measurements.md). From RELAY_FROM
ranks on this host, the controller writes a request once, to the relay, which writes it to
each engine. The replies come back on each rank's own data path, as before.

Every data-path message to a relayed rank goes through the relay while it runs, so a rank's
requests keep their order. The relay runs no user code; should it end anyway (killed), the
ranks get their messages directly from then on, and the cells and calls it may not have
delivered are sent again directly (``resent``: an engine that had them drops the copy).
Other messages it held (an answer to a rank's input(), a widget's change) are lost with it.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch.resending import Unfinished
from monarch_nb.relay import main as relay_main
from monarch_nb.wire import HEADER, FrameConn, connect_local, frame

if TYPE_CHECKING:
    from monarch_nb.dispatch.links import Link, Request, Router
    from monarch_nb.dispatch.protocol import Ctl

RELAY_FROM = 16  # ranks on this host from which their requests go through a relay
COUNT = struct.Struct("!I")


class Relay:
    """The controller's side of one relay process."""

    def __init__(self, router: Router):
        self.router = router
        frames, frames_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        adds, adds_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (frames_there.fileno(), adds_there.fileno())
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", relay_main.__file__, *map(str, fds)],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
        )
        frames_there.close()
        adds_there.close()
        self.conn = FrameConn(frames)
        self.adds = adds
        self.alive = True
        self.lock = threading.Lock()  # alive, the links, sent; a forward keeps its order
        self.links: dict[int, Link] = {}  # relay id -> link
        self._ids = itertools.count(1)
        self.unfinished = Unfinished(router)  # sent again directly if it ends
        threading.Thread(target=self._watch, daemon=True, name="monarch-relay").start()

    # -- membership ----------------------------------------------------------------------------
    def add(self, link: Link) -> bool:
        """Connect the relay to ``link``'s engine (a data connection of its own, made here and
        handed over); False where the engine is not on this host or the relay is gone."""
        hello = link.hello or {}
        sock = connect_local(hello, timeout=1.0)
        if sock is None:
            return False
        try:
            said = {"controller": link.controller, "token": hello["token"], "relay": True}
            sock.sendall(b"".join(frame(said)))
            with self.lock:
                if not self.alive:
                    return False
                ident = next(self._ids)
                socket.send_fds(self.adds, [b"A" + COUNT.pack(ident)], [sock.fileno()])
                self.links[ident] = link
                link.relay, link.relay_id = self, ident
            return True
        except OSError:
            return False
        finally:
            sock.close()  # the relay holds its own copy

    def drop(self, link: Link) -> None:
        with self.lock:
            if self.links.pop(link.relay_id, None) is not None and self.alive:
                with contextlib.suppress(OSError):
                    self.adds.send(b"D" + COUNT.pack(link.relay_id), socket.MSG_DONTWAIT)
            link.relay = None

    # -- sending -------------------------------------------------------------------------------
    def forward(self, links: list[Link], msg: dict[str, Any], framed: tuple[bytes, ...]) -> bool:
        """Send ``framed`` (``msg``, framed once) to every link's engine through the relay;
        False once the relay is gone (the caller sends directly)."""
        inner = b"".join(framed)
        count = len(links)
        head = struct.pack(f"!cI{count}I", b"F", count, *(link.relay_id for link in links))
        with self.lock:
            if not self.alive:
                return False
            try:
                self.conn.post_frame((HEADER.pack(len(head) + len(inner)), head, inner))
            except OSError:
                return False
            self.unfinished.keep(links, msg)
        return True

    # -- its end -------------------------------------------------------------------------------
    def _watch(self) -> None:
        self.proc.wait()
        self._fall_back()

    def _fall_back(self) -> None:
        """The relay ended: its links send directly from now on, and the cells and calls still
        unfinished on them are sent again directly, in the order they were sent."""
        with self.lock:
            if not self.alive:
                return
            self.alive = False
            self.unfinished.send_again()
            self._let_go()

    def close(self) -> None:
        """End the relay (the cluster is going down)."""
        with self.lock:
            self.alive = False
            self._let_go()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _let_go(self) -> None:
        """(Holding the lock, no longer alive.) The links send directly from now on, and the
        relay's sockets close: a relay still running sees their end and exits."""
        for link in self.links.values():
            link.relay = None
        self.links.clear()
        self.conn.close()
        self.adds.close()


# -- the controller's use ----------------------------------------------------------------------
def join(ctl: Ctl, links: list[Link]) -> None:
    """Put ``links`` (just opened) behind the controller's relay, starting it once RELAY_FROM
    ranks share this host; the links opened before join too where nothing is under way on them
    (a request in flight on a link's own path could be overtaken by one through the relay)."""
    relay = ctl._relay
    if relay is None or not relay.alive:
        local = [link for link in ctl._links.values() if _on_this_host(link)]
        if len(local) < RELAY_FROM:
            return
        relay = ctl._relay = Relay(ctl._router)
        busy = {rank for req in list(ctl._router.live.values()) for rank in req.remaining}
        new = {id(link) for link in links}
        links = [link for link in local if id(link) in new or link.info.rank not in busy]
    for link in links:
        relay.add(link)


def _on_this_host(link: Link) -> bool:
    """Whether the link's data path is a Unix-domain socket: its engine is on this host."""
    sock = getattr(link.conn, "sock", None)  # none behind a host's relay (host_relays.py)
    return sock is not None and sock.family == socket.AF_UNIX


def forward(
    ctl: Ctl, req: Request, ranks: list[int], msg: dict[str, Any], framed: tuple[bytes, ...]
) -> list[int]:
    """Send ``msg`` (``framed`` once) to the ranks behind the relay in one message; the ranks
    left for the caller to send to."""
    relay = ctl._relay
    if relay is None or not relay.alive:
        return ranks
    links = ctl._links
    through = [links[r] for r in ranks if r in links and links[r].relay is relay]
    if len(through) < 2 or not relay.forward(through, msg, framed):
        return ranks
    for link in through:
        link.last_sent = req.id
    taken = {link.info.rank for link in through}
    return [r for r in ranks if r not in taken]


def close(ctl: Ctl) -> None:
    if ctl._relay is not None:
        ctl._relay.close()
        ctl._relay = None
