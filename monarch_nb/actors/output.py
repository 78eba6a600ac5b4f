"""What actors print: sent from the actor's worker to whoever spawned its mesh, and shown there.

An actor's thread (and any thread it starts) writes through the process's stream routers
(``capture.py``) as a cell's thread does, into the actor's ``ActorOutbox`` rather than a cell's.
The outbox turns writes into whole lines and sends them on the connection of the mesh's owner,
in order and ahead of the reply of the call that printed them: what a call printed is sent by
the actor's thread when the call ends, before that thread sends the reply; what it prints while
it runs is sent meanwhile from the worker's event loop. The notebook prints them tagged with
the mesh's name and the rank (``show``); an actor that spawned the mesh writes them to its
worker's own log.
``display()`` in an endpoint sends the object's mimebundle the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_nb.rank.capture import PROGRESS_INTERVAL, Outbox


class ActorOutbox(Outbox):
    """One actor's output: capture's ``Outbox`` (whole lines, in order, a long unfinished line
    cut), drained into one message to the mesh's owner at a time. Only what a call has printed
    in full is sent: carriage-return progress is not shown live."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[list[dict]], None]):
        super().__init__(self._wake_loop)
        self._loop = loop
        self._send = send
        # A drain and its send are one step, so what is drained first is sent first whichever
        # thread drains (the event loop while a call runs, the actor's thread as it ends).
        self._sending = threading.Lock()
        self.current = (self, "")  # as a console: threads the actor starts print here too

    def end_call(self) -> None:
        """Send what a call printed, its unfinished line too, now: on the actor's thread,
        which sends the call's reply next."""
        self.end_cell("")
        if self._events:  # a call that printed nothing costs nothing more
            self._drain()

    def _wake_loop(self, urgent: bool) -> None:
        with contextlib.suppress(RuntimeError):  # the worker's loop is closing: nobody to send to
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._sending:
            events, again = self.drain()
            events = [e for e in events if e["ev"] != "progress"]
            if events:
                self._send(events)
        if again:
            with contextlib.suppress(RuntimeError):  # as in _wake_loop
                self._loop.call_soon_threadsafe(
                    self._loop.call_later, PROGRESS_INTERVAL, self._drain
                )


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
    from monarch_nb.dispatch.output import ConsoleSink

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
