"""Writing messages to a distributed comm from its event loop, in order, with low latency."""

from __future__ import annotations

import asyncio
import logging

from distributed.comm import CommClosedError

logger = logging.getLogger("monarch_nb")


class Writer:
    """Writes messages to a comm in order, batching what arrives during a write. Lighter than
    distributed's BatchedSend (no timer per message), which matters for small round trips.
    ``send`` runs on the comm's event loop; the other side reads lists of messages."""

    def __init__(self, comm):
        self.comm = comm
        self._buffer: list[dict] = []
        self._task: asyncio.Task | None = None

    def send(self, *msgs: dict) -> None:
        self._buffer.extend(msgs)
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until everything sent has been written."""
        if self._task is not None:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def _drain(self) -> None:
        try:
            while self._buffer and not self.comm.closed():
                batch, self._buffer = self._buffer, []
                await self.comm.write(batch, on_error="raise")
        except (CommClosedError, OSError):
            self.comm.abort()  # the reader sees it and reports the worker gone
        except Exception:
            logger.exception("cannot write messages to %s", self.comm.peer_address)
            self.comm.abort()
        finally:
            self._task = None
