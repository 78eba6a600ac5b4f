"""What an engine sent through its host's relay and the controller has not yet said it read.

Behind a host relay (monarch_nb/relay/host.py) an engine's replies and output pass through a
process that may end (killed) with some of them in its hands, or in its sockets' buffers. So
a channel whose handshake asked for it (``"retain": True``) keeps every frame it sends, numbered
from 1, until the controller acknowledges it (a ``{"ack": n}`` handshake on a connection of its
own, read by the worker's accepting thread while the rank is busy); when the relay has ended,
the controller connects directly and says how many frames it read (``{"resume": n}``), and the
frames after n are sent again, ahead of anything new: nothing is lost, nothing comes twice.

What is kept is bounded by what the way to the controller holds (its acknowledgement comes
every ACK_BYTES it reads: dispatch/host_relays.py), and at most MAX_RETAINED bytes: past that
(a relay that ended and a controller that does not come back, while the rank prints on) the
oldest frames are given up, and a resume that would need them is refused.
"""

from __future__ import annotations

import collections
import logging
import threading

logger = logging.getLogger("monarch_nb")

MAX_RETAINED = 64 * 1024 * 1024  # bytes


class Retained:
    """Frames sent and not yet acknowledged, oldest first: ``(number, bytes)``."""

    def __init__(self) -> None:
        self.frames: collections.deque[tuple[int, bytes]] = collections.deque()
        self.sent = 0  # frames numbered so far
        self.size = 0
        self.given_up = 0  # the newest frame number dropped past MAX_RETAINED
        # its own: an acknowledgement, read on the accepting thread (which also takes the
        # interrupts), never waits for a send that the way to the controller holds up
        self.lock = threading.Lock()

    def keep(self, data: bytes) -> None:
        with self.lock:
            self.sent += 1
            self.frames.append((self.sent, data))
            self.size += len(data)
            if self.size > MAX_RETAINED:
                self._give_up()

    def _give_up(self) -> None:
        """(Holding the lock.) The oldest frames past MAX_RETAINED go, said once."""
        if not self.given_up:
            logger.warning(
                "monarch_nb: over %d MiB of output kept for a controller that has not come "
                "back; the oldest is given up",
                MAX_RETAINED >> 20,
            )
        while self.size > MAX_RETAINED and len(self.frames) > 1:
            number, old = self.frames.popleft()
            self.size -= len(old)
            self.given_up = number

    def acked(self, n: int) -> None:
        """The controller has read the first ``n`` frames."""
        with self.lock:
            frames = self.frames
            while frames and frames[0][0] <= n:
                self.size -= len(frames.popleft()[1])

    def after(self, n: int) -> list[bytes] | None:
        """The frames after the first ``n``, to send again; None where some were given up."""
        with self.lock:
            if n < self.given_up:
                return None
            return [data for number, data in self.frames if number > n]
