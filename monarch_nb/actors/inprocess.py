"""The caller's own process as an actor host: what ``this_proc()`` spawns in a notebook or a
script runs here, each actor on a thread of its own, as PyTorch Monarch runs actors it spawns on
the client's process.

Messages go to these actors without a socket: the process's ``Mailbox`` has a local connection
whose batches are handed to the same dispatch a worker's I/O thread runs (worker.py), on the
sending thread, and the actors' replies come back to the mailbox the same way. What they print
goes to this process's own stdout, untagged. Their handles stay in this process: no other process
could reach them (the workers never connect to a notebook), so a handle sent elsewhere is refused
in one line (mesh.py).
"""

from __future__ import annotations

import socket
import threading

from monarch_nb.actors.here import IN_PROCESS
from monarch_nb.actors.mailbox import Mailbox, _Direct
from monarch_nb.actors.transport import Channel
from monarch_nb.actors.worker import ActorHost

CLIENT_RANK = -1  # the "cluster rank" of this process's own actors: no rank of the cluster


class InProcessHost(ActorHost):
    """This process's own actors, and the mailbox that reaches them."""

    def __init__(self):  # no worker: ActorHost's worker-bound parts are not used here
        self.worker = None
        self.loop = None
        self.actors = {}
        self.lock = threading.Lock()
        self._wire = None
        self._mailbox = None
        self._mailbox_lock = threading.Lock()
        self.keep = False
        self.address = IN_PROCESS
        self.host_name = socket.gethostname()
        self.box = Mailbox(None, {}, self._reported)
        self.channel = Channel(self.box.id, None)
        self.channel.conn = _Direct(self.box.deliver)
        self.box.add_local(self.address, self._take)

    def _take(self, batch: list[dict]) -> None:
        self._dispatch(self.channel, batch)

    def _reported(self, msg: dict) -> None:
        """What reaches the owner unasked: a failed broadcast or a port's value."""
        from monarch_nb.actors import supervision

        supervision.reached_client(msg, self.host_name)


_lock = threading.Lock()
_here: InProcessHost | None = None


def here() -> InProcessHost:
    """This process's actor host, made on first use."""
    global _here
    with _lock:
        if _here is None:
            _here = InProcessHost()
        return _here
