"""Worker side: fds 1 and 2 of a worker process captured while a cell runs.

In a worker process of its own, what subprocesses and C code write to file descriptors 1 and 2
belongs to the cell running at the time, as it does in a Jupyter kernel. While a cell runs the
descriptors point at pipes; a thread reads them and sends what arrives to the running cell's
console (``capture.Console``), or on to the original descriptors when no cell runs.
"""

from __future__ import annotations

import array
import atexit
import codecs
import contextlib
import ctypes
import io
import os
import select
import selectors
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

SETTLE_MAX = 0.05  # seconds a print waits for descriptor output written before it
PIPE_SIZE = 1024 * 1024  # bytes a captured descriptor's pipe holds (Linux's default maximum)
# An unfinished line this long (the outbox sends one past 64 KiB as a line of its own) waits
# for its end: up to LINE_QUIET with nothing written, LINE_WAIT in all, LINE_MAX bytes (what
# is read and not yet sent on holds up a print, which waits SETTLE_MAX at most: past it, the
# print would come first).
LONG_LINE = 64 * 1024
LINE_QUIET = 0.5
LINE_WAIT = 5.0
LINE_MAX = 4 * 1024 * 1024


class CellConsole(Protocol):
    """What a cell's console (capture.py's ``Console``) does for the captured descriptors."""

    def write_running(self, name: str, s: str) -> bool:
        """Send ``s`` to the running cell; False when none runs."""


class _Pipe:
    """One captured descriptor: the pipe that stands in for it while a cell runs."""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name
        self.saved = os.dup(fd)  # the original, kept for what is written while no cell runs
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        # C code that writes while holding the GIL blocks, holding it, once the pipe is full,
        # and the reader needs the GIL: a larger pipe (Linux) makes that need a larger burst.
        with contextlib.suppress(Exception):
            import fcntl

            fcntl.fcntl(self.write, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.consumed = 0  # bytes read and sent on

    def unread(self) -> int:
        """Bytes written to the pipe and not yet read."""
        import fcntl  # POSIX only, as descriptor capture is
        import termios

        n = array.array("i", [0])
        try:
            fcntl.ioctl(self.read, termios.FIONREAD, n, True)
        except OSError:
            return 0
        return n[0]


try:
    _fflush = ctypes.CDLL(None).fflush  # releases the GIL: a stream's lock may be held long
except (OSError, AttributeError):
    _fflush = None


def _flush_buffers() -> None:
    """What C code buffered in stdio (printf to a pipe is block-buffered), and Python code in
    the process's first stdout/stderr, goes out now."""
    if _fflush is not None:
        _fflush(None)
    for stream in (sys.__stdout__, sys.__stderr__):
        try:  # noqa: SIM105 (twice a cell: a try costs nothing, a suppress() a context)
            stream.flush()
        except Exception:  # None, closed, or a stream a test put there
            pass


class FdCapture:
    """fds 1 and 2 of this process point at pipes while a cell runs; a thread reads them and
    sends what arrives to the running cell, or to the original descriptors when none runs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: list[CellConsole] = []  # the consoles running a cell, latest last
        self.pipes = {name: _Pipe(fd, name) for fd, name in ((1, "stdout"), (2, "stderr"))}
        self._originals: dict[str, Any] = {}
        self._pumps = 0  # times the pipes were read and what came sent on
        self._forgotten = False
        self._hurry = False  # a print waits: a long line waits for its end no longer
        # Which pipes hold something at a cell's end: one call, where reading each pipe
        # until it refused cost a third of a trivial cell's capture.
        self._ready = select.poll()
        for pipe in self.pipes.values():
            self._ready.register(pipe.read, select.POLLIN)
        threading.Thread(target=self._reader, name="monarch-fds", daemon=True).start()
        atexit.register(self.close)

    def original_stream(self, name: str, like) -> io.TextIOWrapper:
        """A text stream on the original descriptor ``name`` stood for."""
        stream = self._originals.get(name)
        if stream is None:
            raw = io.FileIO(self.pipes[name].saved, "w", closefd=False)
            stream = self._originals[name] = io.TextIOWrapper(
                io.BufferedWriter(raw),
                encoding=getattr(like, "encoding", None) or "utf-8",
                errors=getattr(like, "errors", None) or "backslashreplace",
                line_buffering=True,
                write_through=True,
            )
        return stream

    def enter(self, console: CellConsole) -> None:
        _flush_buffers()  # what was printed before the cell is not the cell's
        with self._lock:
            self._running.append(console)
            if len(self._running) == 1:
                for pipe in self.pipes.values():
                    os.dup2(pipe.write, pipe.fd)

    def leave(self, console: CellConsole) -> None:
        _flush_buffers()
        with self._lock:
            try:
                ready = {fd for fd, _ in self._ready.poll(0)}
                for pipe in self.pipes.values():
                    if pipe.read in ready:  # the cell's end waits for no more
                        self._pump_locked(pipe, hurry=True)
                self._pumps += 1  # a settle() waiting on this pump sees it done
            finally:
                if console in self._running:
                    self._running.remove(console)
                if not self._running:
                    for pipe in self.pipes.values():
                        os.dup2(pipe.saved, pipe.fd)

    def settle(self) -> None:
        """Wait (at most SETTLE_MAX) until what was written to fds 1 and 2 so far has been
        sent on, so that a print after ``subprocess.run`` arrives after the subprocess's
        output. Interruptible anywhere: it changes nothing."""
        if not self._running:
            return
        pumps = self._pumps
        targets = [(pipe, pipe.consumed + pipe.unread()) for pipe in self.pipes.values()]
        busy = self._lock.locked()  # a chunk may be read and not yet sent on
        deadline = None
        while (busy and self._pumps == pumps) or any(p.consumed < t for p, t in targets):
            self._hurry = True
            now = time.monotonic()
            if deadline is None:
                deadline = now + SETTLE_MAX
            elif now > deadline:
                return
            time.sleep(0.0002)

    def _reader(self) -> None:
        sel = selectors.DefaultSelector()
        for pipe in self.pipes.values():
            sel.register(pipe.read, selectors.EVENT_READ, pipe)
        while True:
            try:
                for key, _ in sel.select():
                    with self._lock:
                        self._pump_locked(key.data)
            except Exception:  # never stop reading: writers to a full pipe would hang
                time.sleep(0.01)

    def _pump_locked(self, pipe: _Pipe, hurry: bool = False) -> None:
        try:
            while True:
                data = _gather(pipe.read, lambda: hurry or self._hurry)
                if not data:
                    return
                console = self._running[-1] if self._running else None
                text = pipe.decoder.decode(data) if console is not None else ""
                if console is None or not console.write_running(pipe.name, text):
                    pipe.decoder.reset()
                    _write_all(pipe.saved, data)
                pipe.consumed += len(data)
        finally:
            self._pumps += 1
            self._hurry = False

    def forget(self) -> None:
        """In a process forked from the worker: the pipes are the worker's to read (a child
        that exits normally would read them at exit, taking what others wrote)."""
        self._forgotten = True
        for pipe in self.pipes.values():
            with contextlib.suppress(OSError):
                os.close(pipe.read)
            with contextlib.suppress(OSError):
                os.close(pipe.write)

    def close(self) -> None:
        """At exit: what is still in the pipes goes to the original descriptors."""
        if self._forgotten:
            return
        if not self._lock.acquire(timeout=1):  # the reader stuck writing: exit all the same
            return
        try:
            self._running.clear()
            for pipe in self.pipes.values():
                os.dup2(pipe.saved, pipe.fd)
                self._pump_locked(pipe, hurry=True)
        finally:
            self._lock.release()


def _gather(fd: int, hurry: Callable[[], bool]) -> bytes:
    """What the pipe holds now, read in one go, so that a line written at once arrives whole
    (a read returns 64 KiB at most); a long unfinished line waits a little for its end, which
    a writer may send in pieces (C's stdio) or that may not fit in the pipe, unless ``hurry()``
    (a print waits for what is in the pipe)."""
    chunks: list[bytes] = []
    size = tail = 0  # bytes gathered; of them, after the last newline
    deadline = None
    while True:
        try:
            data = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            data = None
        if data:
            chunks.append(data)
            size += len(data)
            newline = data.rfind(b"\n")
            tail = tail + len(data) if newline < 0 else len(data) - newline - 1
            # A writer faster than the reader: send on what came, in whole lines where it can.
            # A hurried read goes on too: the print waits for all that is in the pipe anyway,
            # and a long line's end may be in it (sent on here, the line would arrive split).
            if size >= LINE_MAX or (size >= PIPE_SIZE and tail < LONG_LINE):
                break
            continue
        if data is not None or tail < LONG_LINE or not _more(fd, hurry):
            break
        deadline = deadline or time.monotonic() + LINE_WAIT
        if time.monotonic() >= deadline:
            break
    return b"".join(chunks)


def _more(fd: int, hurry: Callable[[], bool]) -> bool:
    """Whether more is written to ``fd`` within LINE_QUIET, and no one hurries the reader
    (looked at every 5 ms)."""
    quiet = time.monotonic() + LINE_QUIET
    while not hurry() and time.monotonic() < quiet:
        if select.select([fd], [], [], 0.005)[0]:
            return True
    return False


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]
