"""Worker side: capture what a cell prints and queue it, in order, for its controller.

``sys.stdout`` and ``sys.stderr`` of a worker process are replaced by routers. A write from the
thread running a cell goes to that cell's outbox; a write from a thread that a cell started (or
that such a thread started, and so on) goes to the cell its engine runs at that moment, and is
held for the engine's next cell while none runs; any other write (Dask's own logging) goes to
the original stream.

In a worker process of its own (one started by a nanny), file descriptors 1 and 2 are also
pointed at pipes while a cell runs, so that what subprocesses and C code write there reaches the
cell; a thread reads the pipes, and what arrives while no cell runs (a background subprocess)
goes on to the original descriptors.

The outbox turns writes into whole lines, keeps a carriage-return progress bar as one line that
is sent at most a few times a second, and coalesces lines so a flood of prints becomes a few
large messages rather than one message per line.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from monarch_nb.rank.capture_fds import FdCapture

PROGRESS_INTERVAL = 0.25  # seconds between updates of a carriage-return progress line
MAX_PARTIAL = 64 * 1024  # a line without a newline is sent once it grows past this
HELD_MAX = 1024 * 1024  # characters that cells' threads print between cells, kept for the next

_local = threading.local()
_fds: FdCapture | None = None  # this process's descriptor capture, where it has one
_routers: list[StreamRouter] = []  # the routers install_routers made, stdout's first
_forked = False  # this process was forked from a worker (see _after_fork_in_child)


def current_capture() -> tuple[Outbox, str] | None:
    """The (outbox, cell id) that the calling thread's output belongs to, if any."""
    cap = getattr(_local, "capture", None)
    if cap is None:
        console = getattr(threading.current_thread(), "_monarch_console", None)
        if console is not None:
            cap = console.current
    return cap


class Console:
    """Where the output of one engine's cells, and of the threads they start, goes."""

    def __init__(self):
        self._lock = threading.RLock()  # RLock: a print in a finaliser run while it is held
        self.current: tuple[Outbox, str] | None = None
        self._held: list[tuple[str, str]] = []
        self._held_size = 0
        self._spilled = 0  # characters past HELD_MAX, sent to the worker's own stream

    @contextmanager
    def running(self, outbox: Outbox, cell_id: str):
        """Run a cell on the calling thread. Its output, that of the threads it starts and
        (with descriptor capture) what is written to fds 1 and 2 go to ``outbox``, after what
        the engine's threads printed since its last cell. Call it outside user code: no
        asynchronous interrupt may land on entering or leaving."""
        with self._lock:
            self.current = (outbox, cell_id)
            held, self._held, self._held_size = self._held, [], 0
            for name, s in held:
                outbox.write(cell_id, name, s)
            if self._spilled:
                outbox.write(
                    cell_id,
                    "stderr",
                    f"[monarch] threads printed {self._spilled} more characters between cells "
                    "than are kept for the next one; those went to the worker's own log\n",
                )
                self._spilled = 0
        previous = getattr(_local, "capture", None), getattr(_local, "console", None)
        _local.capture, _local.console = (outbox, cell_id), self
        fds = _fds
        try:
            if fds is not None:
                fds.enter(self)
            yield
        finally:
            try:
                if fds is not None:
                    fds.leave(self)  # what the cell wrote to fds 1 and 2 arrives before its end
            finally:
                with self._lock:
                    self.current = None
                _local.capture, _local.console = previous

    def write(self, name: str, s: str, fallback) -> None:
        """A write from a thread a cell started: to the cell running now, else held."""
        with self._lock:
            if self.current is not None:
                outbox, cell_id = self.current
                outbox.write(cell_id, name, s)
                return
            if not self._spilled and self._held_size + len(s) <= HELD_MAX:
                self._held.append((name, s))
                self._held_size += len(s)
                return
            self._spilled += len(s)
        fallback.write(s)

    def write_running(self, name: str, s: str) -> bool:
        """Send ``s`` to the running cell; False when none runs."""
        with self._lock:
            if self.current is None:
                return False
            outbox, cell_id = self.current
            outbox.write(cell_id, name, s)
            return True


def route_thread(outbox, console) -> None:
    """What the calling thread (an actor's) writes goes to ``outbox``; what threads it starts
    write goes to ``console``."""
    _local.capture, _local.console = (outbox, ""), console


@contextmanager
def redirect(target):
    """What the calling thread writes and displays goes to ``target`` (an object with an
    Outbox's ``write`` and ``emit``: an Output widget on a rank) until the block ends."""
    previous = getattr(_local, "capture", None)
    _local.capture = (target, "")
    try:
        yield
    finally:
        _local.capture = previous


def _console_of_caller() -> Console | None:
    """The console a thread started now by the calling thread belongs to."""
    console = getattr(_local, "console", None)
    if console is None:
        console = getattr(threading.current_thread(), "_monarch_console", None)
    return console


_thread_start = threading.Thread.start  # replaced by install_routers with _start


def _start(self, *args, **kwargs):
    """Thread.start, remembering which engine's cell (if any) started the thread."""
    console = _console_of_caller()
    if console is not None:
        self._monarch_console = console
    return _thread_start(self, *args, **kwargs)


class StreamRouter(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr in a worker process."""

    def __init__(self, original, name: str):
        self.original = original
        self.name = name
        self.fd = 1 if name == "stdout" else 2

    def write(self, s: str) -> int:
        if _forked:
            return self.original.write(s)
        cap = getattr(_local, "capture", None)
        console = None
        if cap is None:
            console = getattr(threading.current_thread(), "_monarch_console", None)
            if console is None:
                return self.original.write(s)
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        fds = _fds
        if fds is not None:
            fds.settle()
        if cap is not None:
            cap[0].write(cap[1], self.name, s)
        else:
            console.write(self.name, s, self.original)
        return len(s)

    def flush(self) -> None:
        if _forked or current_capture() is None:
            self.original.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # with descriptor capture, fds 1 and 2: they reach the running cell
        return self.fd if _fds is not None else self.original.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.original, "encoding", "utf-8")

    @property
    def buffer(self) -> _BytesRouter:
        """``sys.stdout.buffer``: bytes, decoded and routed as text."""
        return _BytesRouter(self)

    def writable(self) -> bool:
        return True


class _BytesRouter(io.RawIOBase):
    def __init__(self, router: StreamRouter):
        self._router = router

    def write(self, b) -> int:
        data = bytes(b)
        self._router.write(data.decode(self._router.encoding, "replace"))
        return len(data)

    def flush(self) -> None:
        self._router.flush()

    def fileno(self) -> int:
        return self._router.fileno()

    def writable(self) -> bool:
        return True


def install_routers(fds: bool = False) -> None:
    """Route this process's stdout/stderr by thread, attribute threads to the cell that
    started them and, with ``fds``, capture fds 1 and 2 while cells run (idempotent). Only a
    process of its own may capture descriptors: they are the whole process's."""
    global _fds, _thread_start
    if threading.Thread.start is not _start:
        _thread_start = threading.Thread.start
        threading.Thread.start = _start
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, StreamRouter):
            setattr(sys, name, StreamRouter(stream, name))
            _routers.append(getattr(sys, name))
            if len(_routers) == 1 and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
    if not fds or _fds is not None or os.name != "posix":
        return
    capture = FdCapture()
    routers = {}  # id of a stream that writes to fd 1 or 2 -> the router standing in for it
    for name in ("stdout", "stderr"):
        router = getattr(sys, name)
        routers[id(router.original)] = routers[id(getattr(sys, f"__{name}__"))] = router
        with contextlib.suppress(Exception):
            router.original.flush()
        # The router's writes that are not a cell's go to the original descriptor itself,
        # never through the pipe that fds 1 and 2 are while a cell runs.
        router.original = capture.original_stream(name, router.original)
    _point_handlers_at(routers)
    if faulthandler.is_enabled():  # a crash's traceback must not wait in a pipe that dies
        faulthandler.enable(file=sys.stderr.original, all_threads=True)
    _fds = capture


def _after_fork_in_child() -> None:
    """A process forked from a worker (multiprocessing's fork context, a fork Pool, os.fork)
    has copies of the outboxes but not the threads that send them on, so what it printed was
    lost. Its routers write where any child's output goes: with descriptor capture to fds 1
    and 2, which while a cell runs are the pipes the worker reads, so it reaches the cell
    (else the worker's own log); without, to the original streams (in a kernel, ipykernel's,
    which sends a forked child's output on). Line-buffered, as on a terminal: a line printed
    before ``os._exit`` is out, and multiprocessing flushes the streams as its children end."""
    global _forked, _fds
    _forked = True
    if _fds is None:
        return
    _fds.forget()
    _fds = None
    for router in _routers:
        router.original = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(router.fd, "w", closefd=False)),
            encoding=router.encoding,
            errors="backslashreplace",
            line_buffering=True,
        )


def _point_handlers_at(routers: dict) -> None:
    """Logging handlers that write to the process's original streams (Dask's, set up when it
    was imported) write to the routers instead: kept out of the cells' descriptors, and still
    in the cell when a cell logs."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in routers:
                handler.setStream(routers[id(handler.stream)])


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
                event = item[0]
                if event["ev"] == "clear":  # an unfinished line is cleared with the rest
                    for name in ("stdout", "stderr"):
                        self._partial.pop((event["id"], name), None)
                self._events.append(event)
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
