"""What actors print: sent from the actor's worker to whoever spawned its mesh, and shown there.

An actor's thread (and any thread it starts) writes through the process's stream routers
(``capture.py``) as a cell's thread does, into the actor's ``ActorOutbox`` rather than a cell's.
The outbox turns writes into whole lines and sends them over the comm of the mesh's owner, in
order and ahead of the reply of the call that printed them (both go through the worker's event
loop, first come first sent). The notebook prints them tagged with the mesh's name and the
rank (``show``); an actor that spawned the mesh writes them to its worker's own log.
``display()`` in an endpoint sends the object's mimebundle the same way.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import Callable
from typing import Any

from .capture import MAX_PARTIAL, _last_segment


class ActorOutbox:
    """One actor's output. ``write`` and ``emit`` are called by the routers on the actor's
    threads; ``send`` runs on the worker's event loop with a batch of events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[list[dict]], None]):
        self._loop = loop
        self._send = send
        self._lock = threading.RLock()  # RLock: a finaliser run while it is held may print
        self._events: list[dict[str, Any]] = []
        self._partial = {"stdout": "", "stderr": ""}
        self._scheduled = False
        self.current = (self, "")  # as a console: threads the actor starts print here too

    def write(self, _cell_id: str, name: str, s: str) -> None:
        with self._lock:
            buf = self._partial.get(name, "") + s
            if "\n" in buf:
                *lines, buf = buf.split("\n")
                self._add(name, [_last_segment(line) for line in lines])
            if len(buf) > MAX_PARTIAL:
                self._add(name, [_last_segment(buf)])
                buf = ""
            self._partial[name] = buf
        self._schedule()

    def emit(self, event: dict[str, Any], urgent: bool = False) -> None:
        with self._lock:
            self._events.append({k: v for k, v in event.items() if k != "id"})
        self._schedule()

    def end_call(self) -> None:
        """Send what a call printed without a final newline, ahead of its reply."""
        with self._lock:
            for name, rest in self._partial.items():
                if rest:
                    self._add(name, [_last_segment(rest)])
                    self._partial[name] = ""
        self._schedule()

    def _add(self, name: str, lines: list[str]) -> None:
        last = self._events[-1] if self._events else None
        if last and last["ev"] == "stream" and last["name"] == name:
            last["lines"].extend(lines)
        else:
            self._events.append({"ev": "stream", "name": name, "lines": lines})

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled or not self._events:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the worker's loop is closing: nobody to send to
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            self._scheduled = False
        if events:
            self._send(events)


class ActorConsole:
    """Where threads an actor starts write (``capture.Console``'s interface)."""

    def __init__(self, outbox: ActorOutbox):
        self.outbox = outbox
        self.current = (outbox, "")

    def write(self, name: str, s: str, fallback) -> None:
        self.outbox.write("", name, s)


def show(msg: dict[str, Any]) -> None:
    """Print what an actor sent, tagged ``[mesh rank N]``, in a fresh context: ipykernel 7
    files a thread's output under the cell its context came from, and without one under the
    cell running now, which is the cell waiting on the call."""
    contextvars.Context().run(_show, msg)


def _show(msg: dict[str, Any]) -> None:
    from .output import ConsoleSink

    tag = f"[{msg['mesh']} rank {msg['r']}]"
    for event in msg["out"]:
        if event["ev"] == "stream":
            stream = sys.stderr if event["name"] == "stderr" else sys.stdout
            stream.write("".join(f"{tag} {line}\n" for line in event["lines"]))
            stream.flush()
        elif event["ev"] == "clear":
            ConsoleSink().clear(event["wait"])
        elif event["ev"] == "display":
            ConsoleSink().display(
                [msg["r"]],
                event["data"],
                event["metadata"],
                event.get("display_id"),
                update=event.get("update", False),
            )
