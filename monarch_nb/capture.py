"""Worker side: capture what a cell prints and queue it, in order, for its controller.

``sys.stdout`` and ``sys.stderr`` of a worker process are replaced by routers: a write from a
thread that is running a cell goes to that cell's outbox, any other write (Dask's own logging)
to the original stream. The outbox turns writes into whole lines, keeps a carriage-return
progress bar as one line that is sent at most a few times a second, and coalesces lines so a
flood of prints becomes a few large messages rather than one message per line.
"""

from __future__ import annotations

import collections
import io
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

PROGRESS_INTERVAL = 0.25  # seconds between updates of a carriage-return progress line
MAX_PARTIAL = 64 * 1024  # a line without a newline is sent once it grows past this

_local = threading.local()


def current_capture() -> tuple[Outbox, str] | None:
    """The (outbox, cell id) that the calling thread's output belongs to, if any."""
    return getattr(_local, "capture", None)


@contextmanager
def capturing(outbox: Outbox, cell_id: str):
    previous = current_capture()
    _local.capture = (outbox, cell_id)
    try:
        yield
    finally:
        _local.capture = previous


class StreamRouter(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr in a worker process."""

    def __init__(self, original, name: str):
        self.original = original
        self.name = name

    def write(self, s: str) -> int:
        cap = current_capture()
        if cap is None:
            return self.original.write(s)
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        cap[0].write(cap[1], self.name, s)
        return len(s)

    def flush(self) -> None:
        if current_capture() is None:
            self.original.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.original.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.original, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def install_routers() -> None:
    """Route this process's stdout/stderr by thread (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, StreamRouter):
            setattr(sys, name, StreamRouter(stream, name))


def _last_segment(text: str) -> str:
    """What a terminal shows for a line rewritten with carriage returns."""
    if "\r" not in text:
        return text
    pieces = [p for p in text.split("\r") if p]
    return pieces[-1] if pieces else ""


class Outbox:
    """Ordered events for one controller; ``wake(urgent)`` asks the event loop to drain it.

    A cell's thread can be interrupted at any bytecode (the engine raises KeyboardInterrupt in
    it asynchronously), so on that thread ``write`` and ``emit`` only append to a queue, one
    atomic step: a write is either queued whole or not at all. Turning writes into lines, which
    updates two structures, happens when the queue is absorbed: by the flusher thread, or by the
    cell's thread once user code has ended (``end_cell``, the reply), where no interrupt lands.
    """

    def __init__(self, wake: Callable[[bool], None]):
        self._wake = wake
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple] = collections.deque()
        self._events: list[dict[str, Any]] = []
        self._partial: dict[tuple[str, str], str] = {}
        self._cut: set[tuple[str, str]] = set()  # a partial line went out; its newline is no line
        self._progress_dirty = False
        self._last_progress = 0.0
        self._scheduled = False

    def write(self, cell_id: str, name: str, s: str) -> None:
        self._queue.append((cell_id, name, s))
        self._schedule(False)

    def emit(self, event: dict[str, Any], urgent: bool = False) -> None:
        self._queue.append((event,))
        self._schedule(urgent)

    def _schedule(self, urgent: bool) -> None:
        with self._lock:
            wake = urgent or not self._scheduled
            self._scheduled = True
        if wake:
            self._wake(urgent)

    def _absorb_locked(self) -> None:
        """Move the queued writes and events, in order, into lines and events."""
        while self._queue:
            item = self._queue.popleft()
            if len(item) == 1:
                self._events.append(item[0])
                continue
            cell_id, name, s = item
            key = (cell_id, name)
            buf = self._partial.get(key, "") + s
            if "\n" in buf:
                *lines, buf = buf.split("\n")
                if key in self._cut:
                    self._cut.discard(key)
                    if not lines[0]:  # the newline that ends a line already sent
                        lines.pop(0)
                if lines:
                    self._add_lines(cell_id, name, [_last_segment(line) for line in lines])
            if len(buf) > MAX_PARTIAL:
                self._add_lines(cell_id, name, [_last_segment(buf)])
                buf = ""
                self._cut.add(key)
            self._partial[key] = buf
            if buf:
                self._progress_dirty = True

    def _add_lines(self, cell_id: str, name: str, lines: list[str]) -> None:
        last = self._events[-1] if self._events else None
        if last and last["ev"] == "stream" and last["id"] == cell_id and last["name"] == name:
            last["lines"].extend(lines)
        else:
            self._events.append({"ev": "stream", "id": cell_id, "name": name, "lines": lines})

    def end_cell(self, cell_id: str) -> None:
        """Send what the cell printed without a final newline as a last line. Called on the
        cell's thread after its user code has ended."""
        with self._lock:
            self._absorb_locked()
            for name in ("stdout", "stderr"):
                self._cut.discard((cell_id, name))
                rest = self._partial.pop((cell_id, name), "")
                if rest:
                    self._add_lines(cell_id, name, [_last_segment(rest)])

    def drain(self) -> tuple[list[dict[str, Any]], bool]:
        """The events to send now, and whether to drain again soon (a progress line waits)."""
        with self._lock:
            self._absorb_locked()
            events, self._events = self._events, []
            again = False
            if self._progress_dirty:
                now = time.monotonic()
                if now - self._last_progress >= PROGRESS_INTERVAL:
                    for (cell_id, name), text in self._partial.items():
                        if text:
                            events.append(
                                {
                                    "ev": "progress",
                                    "id": cell_id,
                                    "name": name,
                                    "text": _last_segment(text),
                                }
                            )
                    self._last_progress = now
                    self._progress_dirty = False
                else:
                    again = True
            self._scheduled = again
            return events, again
