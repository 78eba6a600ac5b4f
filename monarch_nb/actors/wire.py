"""What a caller of actors gets back: futures, the errors an actor call raises (``ActorError``,
``SupervisionError``), and the source lines put back into remote tracebacks. The messages
themselves travel through mailbox.py and transport.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import linecache
import os
import re
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

import cloudpickle

from monarch_nb.actors.actor import EndpointProperty
from monarch_nb.actors.stops import stops
from monarch_nb.dispatch.results import Interrupted, RemoteError

# Frames of these files are the machinery's, not the user's: left out of remote tracebacks
_WORKER_FILE = os.path.join(os.path.dirname(__file__), "worker.py")
# Source spans kept per function name: a class redefined in cell after cell keeps only its
# latest versions (the older ones are what tracebacks least often show).
MAX_SPANS = 16


class ActorError(RemoteError):
    """An endpoint (or ``__init__``) raised on one rank; carries the remote traceback.
    ``exception`` is the original exception when it could be sent back, else None."""

    def __init__(
        self, rank, host, ename, evalue, traceback, where: str, exception=None, post_mortem=None
    ):
        super().__init__(rank, host, ename, evalue, traceback)
        self.where = where
        self.exception = exception
        self.post_mortem = post_mortem  # (token, process rank) where the traceback is kept
        self.args = (f"{where} failed on rank {rank}: {ename}: {evalue}",)

    def __str__(self) -> str:
        tb = "\n".join(self.traceback)
        return f"{self.args[0]}\n{tb}" if tb else self.args[0]

    def debug(self) -> None:
        """pdb on the rank where the call failed, at the endpoint's frames, from the notebook's
        input box (as ``%monarch debug`` after a cell); ``q`` ends it."""
        from monarch_nb.dispatch import prompting

        prompting.debug_actor(self)

    def __reduce__(self):
        args = (self.rank, self.host, self.ename, self.evalue, self.traceback, self.where)
        state = {"exception": _dumps_or_none(self.exception), "post_mortem": self.post_mortem}
        return type(self), args, state

    def __setstate__(self, state: dict) -> None:
        # The exception travels as bytes: where it cannot be pickled (or unpickled on the
        # other side) the error still travels, with ``exception`` None.
        blob = state.get("exception")
        self.post_mortem = state.get("post_mortem")
        self.exception = None
        if blob is not None:
            with contextlib.suppress(Exception):
                self.exception = cloudpickle.loads(blob)

    def _render_traceback_(self) -> list[str]:
        return [f"ActorError: {self.args[0]} (on {self.host})", *self.traceback]


def _dumps_or_none(exc: BaseException | None) -> bytes | None:
    if exc is None:
        return None
    try:
        return cloudpickle.dumps(exc, protocol=5)
    except Exception:
        return None


class SupervisionError(RuntimeError):
    """The worker process of an actor died (or was removed); names the rank and the cause."""

    def __init__(self, mesh: str, rank: int, address: str, cause: str):
        super().__init__(f"actor mesh {mesh!r} rank {rank} is dead: {cause} (worker {address})")
        self.mesh, self.rank, self.address, self.cause = mesh, rank, address, cause

    def __reduce__(self):
        return type(self), (self.mesh, self.rank, self.address, self.cause)

    def _render_traceback_(self) -> list[str]:
        return [f"SupervisionError: {self}"]


class MeshStopped(SupervisionError):
    """A message to actors whose mesh was stopped (``stop()``, or their ProcMesh's)."""

    def __init__(self, mesh: str, rank: int, address: str, cause: str):
        RuntimeError.__init__(
            self, f"actor mesh {mesh!r} was stopped ({cause}): spawn it again to send to it"
        )
        self.mesh, self.rank, self.address, self.cause = mesh, rank, address, cause

    def _render_traceback_(self) -> list[str]:
        return [f"MeshStopped: {self}"]


class Future:
    """A result that arrives later: ``.get(timeout=...)`` from plain code, ``await`` on any
    asyncio loop (a notebook cell's top-level await, an async endpoint)."""

    # Future[int] in annotations, as torchmonarch's code writes them
    __class_getitem__ = classmethod(types.GenericAlias)

    def __init__(self, describe: str, decode: Callable[[Any], Any] = lambda raw: raw):
        self._describe = describe
        self._decode = decode
        self._event = threading.Event()
        self._raw: Any = None
        self._error: BaseException | None = None
        self._decoded = False
        self._value: Any = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def failed(cls, describe: str, error: BaseException) -> Future:
        fut = cls(describe)
        fut._finish(error=error)
        return fut

    def _finish(self, raw: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._raw, self._error = raw, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the result is in (at once if it already is); runs on any thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def done(self) -> bool:
        return self._event.is_set()

    def get(self, timeout: float | None = None) -> Any:
        try:
            if threading.current_thread() is threading.main_thread():
                answered = self._wait_attaching(timeout)
            else:
                answered = self._event.wait(timeout)
        except KeyboardInterrupt:
            raise Interrupted(
                f"stopped waiting for {self._describe}; the endpoint goes on running (a later "
                "get() still has its answer)"
            ) from None
        if not answered:
            raise TimeoutError(f"{self._describe} did not answer within {timeout:g} s")
        if self._error is not None:
            # The same object is raised by every get(): without the reset its traceback would
            # gain this call's frames each time.
            raise self._error.with_traceback(None)
        if not self._decoded:
            self._value, self._decoded = self._decode(self._raw), True
        return self._value

    result = get

    def _wait_attaching(self, timeout: float | None) -> bool:
        """Wait; an endpoint that stops in pdb meanwhile gets the notebook's prompt."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            if stops.event.is_set():
                from monarch_nb.dispatch import prompting

                for rank in stops.take():
                    prompting.attach_actor(rank)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._event.wait(0.1 if left is None else min(0.1, left))
        return True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        if not self._event.is_set():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake() -> None:
                with contextlib.suppress(RuntimeError):  # the awaiting loop has closed
                    loop.call_soon_threadsafe(_resolve, waiter)

            self.add_done_callback(wake)
            await waiter
        return self.get(0)

    def __repr__(self) -> str:
        return f"<Future {self._describe}: {'done' if self.done() else 'pending'}>"


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


_OK = {"ok": True, "v": None}


def _value(value: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "v": cloudpickle.dumps(value, protocol=5)}
    except BaseException as e:  # whatever a __reduce__ raises, the call gets its answer
        return _plain_error(f"the return value ({type(value).__name__}) cannot be pickled: {e}")


def _error(exc: BaseException) -> dict[str, Any]:
    """The reply for an exception, whatever it does: one whose ``str()`` or pickling raises
    still answers the call (an unanswered call waits for ever)."""
    try:
        te = traceback.TracebackException.from_exception(exc)
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if f.filename not in (_WORKER_FILE, cloudpickle.__file__)]
        )
        lines = "".join(te.format()).rstrip("\n").splitlines()
    except Exception:
        lines = []
    try:
        evalue = str(exc)
    except Exception as e:
        evalue = f"<str() of the exception raised {type(e).__name__}>"
    try:
        blob = cloudpickle.dumps(exc, protocol=5)
    except BaseException:
        blob = None
    error = {"ename": type(exc).__name__, "evalue": evalue, "traceback": lines, "exc": blob}
    return {"ok": False, "e": error}


def _plain_error(text: str) -> dict[str, Any]:
    error = {"ename": "RuntimeError", "evalue": text, "traceback": [], "exc": None}
    return {"ok": False, "e": error}


def decode_error(reply: dict[str, Any], host: str, where: str) -> ActorError:
    e = reply["e"]
    exc = None
    if e.get("exc") is not None:
        with contextlib.suppress(Exception):
            exc = cloudpickle.loads(e["exc"])
    lines = sources.restore(e["traceback"])
    pm = tuple(e["pm"]) if e.get("pm") else None
    return ActorError(reply["r"], host, e["ename"], e["evalue"], lines, where, exc, pm)


class _Sources:
    """Where the code of spawned classes came from. cloudpickle sends functions defined in a
    notebook with their file name replaced by ``<dynamic-code>`` (line numbers are kept), so the
    caller puts the file and the source line back into the remote traceback. A frame names only
    its function and line, so a class redefined in a later cell matches both versions: the spans
    first seen most recently come first, as a redefinition is what runs from then on."""

    _FRAME = re.compile(r'^  File "<dynamic-code>", line (\d+), in (.+)$')

    def __init__(self):
        self._spans: dict[str, list[tuple[str, int, int]]] = {}

    def remember(self, cls: type) -> None:
        module = sys.modules.get(cls.__module__)
        values = [v for k in cls.__mro__ for v in vars(k).values()]
        values += list(vars(module).values()) if module is not None else []
        new: dict[str, list[tuple[str, int, int]]] = {}  # the class's own before the module's
        for value in values:
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            elif isinstance(value, EndpointProperty):
                value = value.method
            if not inspect.isfunction(value):
                continue
            code = value.__code__
            if code.co_filename.startswith("<dynamic"):
                continue
            last = max((line for _, _, line in code.co_lines() if line), default=0)
            span = (code.co_filename, code.co_firstlineno, last)
            found = new.setdefault(code.co_name, [])
            if span not in found and span not in self._spans.get(code.co_name, []):
                found.append(span)
        for name, found in new.items():
            self._spans[name] = (found + self._spans.get(name, []))[:MAX_SPANS]

    def restore(self, lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            m = self._FRAME.match(line)
            span = m and next(
                (s for s in self._spans.get(m[2], []) if s[1] <= int(m[1]) <= s[2]), None
            )
            if not span:
                out.append(line)
                continue
            out.append(f'  File "{span[0]}", line {m[1]}, in {m[2]}')
            text = linecache.getline(span[0], int(m[1])).strip()
            if text:
                out.append(f"    {text}")
        return out


sources = _Sources()
