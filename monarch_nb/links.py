"""Controller side of the wire: one comm per rank, straight to the worker's engine.

Requests go out through a Writer on the client's event loop; events come back on the same
comm and are routed by request id to the Request's thread-safe queue, where the controller's
thread (the notebook's main thread) picks them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from distributed.comm import CommClosedError, connect

from .wire import Writer

_ids = itertools.count(1)


def new_id(kind: str) -> str:
    return f"{kind}-{next(_ids)}-{uuid.uuid4().hex[:6]}"


@dataclass
class RankInfo:
    rank: int
    name: Any
    address: str
    host: str
    local_rank: int = 0
    alive: bool = True


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


class Router:
    """Live requests by id; the links deliver events here from the event loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        with self._lock:
            self._requests[request.id] = request

    def deliver(self, rank: int, ev: dict[str, Any]) -> None:
        with self._lock:
            req = self._requests.get(ev["id"])
            if req is None:
                return
            if ev["ev"] == "done":
                req.status[rank] = ev["status"]
                req.remaining.discard(rank)
                if not req.remaining:
                    del self._requests[req.id]
        req.events.put((rank, ev))

    def lost(self, rank: int, why: str) -> None:
        """Finish every request still waiting on ``rank``: its worker is gone."""
        with self._lock:
            waiting = [r for r in self._requests.values() if rank in r.remaining]
        for req in waiting:
            self.deliver(rank, {"ev": "done", "id": req.id, "status": "lost", "why": why})

    def busy(self, kind: str = "execute") -> dict[int, str]:
        """Ranks with an unfinished request of ``kind``, and that request's id."""
        with self._lock:
            return {
                rank: req.id
                for req in self._requests.values()
                if req.kind == kind
                for rank in req.remaining
            }


class Link:
    """The controller's comm to one rank's engine. Methods run on the client's event loop."""

    def __init__(self, info: RankInfo, router: Router, on_lost=None):
        self.info = info
        self.router = router
        self.on_lost = on_lost  # called with (rank, why) when the worker goes away
        self.closing = False
        self.comm = None
        self.writer: Writer | None = None
        self.reader: asyncio.Future | None = None

    async def open(self, controller: str, world_size: int, setup_id: str, connection_args) -> None:
        self.comm = await connect(self.info.address, **connection_args)
        await self.comm.write(
            {
                "op": "monarch_attach",
                "reply": False,
                "controller": controller,
                "setup_id": setup_id,
                "rank": self.info.rank,
                "world_size": world_size,
                "local_rank": self.info.local_rank,
            }
        )
        self.writer = Writer(self.comm)

    async def read_forever(self) -> None:
        why = "its connection closed"
        try:
            while True:
                for ev in await self.comm.read():
                    self.router.deliver(self.info.rank, ev)
        except (CommClosedError, OSError) as e:
            why = f"its connection closed ({type(e).__name__})"
        finally:
            self.info.alive = False
            self.router.lost(self.info.rank, why)
            if self.on_lost is not None and not self.closing:
                self.on_lost(self.info.rank, why)

    def send(self, msg: dict[str, Any]) -> None:
        if self.writer is None or self.comm is None or self.comm.closed():
            self.router.deliver(
                self.info.rank,
                {"ev": "done", "id": msg.get("id", ""), "status": "lost", "why": "not connected"},
            )
            return
        self.writer.send(msg)

    async def close(self) -> None:
        self.closing = True
        if self.writer is not None:
            with contextlib.suppress(Exception):
                await self.writer.flush(timeout=2)
        if self.comm is not None and not self.comm.closed():
            self.comm.abort()
