"""Worker side of a rank: its namespace, the thread that runs its cells, output, interrupt.

A controller opens a comm straight to the worker's ``monarch_attach`` handler and keeps it for
control: ``interrupt`` and ``info`` are answered on the worker's event loop at once, even while
a cell runs. Cells and calls travel on the data path of engine_io.py, read by the rank's own
thread, which runs them one at a time; a long cell never blocks the event loop (heartbeats keep
flowing).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import contextlib
import ctypes
import inspect
import linecache
import os
import platform
import socket
import sys
import threading
import time
import traceback
import types
import uuid
from typing import Any

import cloudpickle
from distributed import WorkerPlugin
from distributed.comm import CommClosedError
from distributed.core import Status

from monarch_nb.rank import comms as rank_comms
from monarch_nb.rank import session
from monarch_nb.rank import shell as rank_shell
from monarch_nb.rank.capture import Console, current_capture, install_routers
from monarch_nb.rank.engine_io import Channel, Wire

PLUGIN_NAME = "monarch-engine"
IDENTITY = ("rank", "world_size", "local_rank", "host", "device", "display", "get_ipython")
CELL_PREFIX = "<monarch cell "
MAX_CANCELLED = 1024  # ids of interrupted-before-they-ran requests remembered


_engine: Engine | None = None  # the engine of this worker process, once it has one

# The namespaces of the cells running in this process, latest last, and the __main__ they stand
# in for (see Engine.as_main).
_mains: list[types.ModuleType] = []
_mains_lock = threading.Lock()
_saved_main: types.ModuleType | None = None


def get_engine() -> Engine | None:
    """The engine of the worker process this code runs in (a cell, an actor, a task), or None
    outside a monarch worker."""
    return _engine


class Engine:
    """The rank's namespace and the thread that executes everything sent to it, in order."""

    def __init__(self, worker):
        self.worker = worker
        self.loop = worker.loop
        self.host = socket.gethostname()
        self.identity: dict[str, Any] = {}
        self.device_info: dict[str, Any] = {}
        # The namespace is a module's __dict__, as IPython's is: ``as_main`` makes the module
        # ``__main__`` while a cell runs, so pickle finds the classes the cells define.
        self.main = types.ModuleType("__main__")
        self.namespace: dict[str, Any] = self.main.__dict__
        self.namespace.clear()  # empty until setup fills it
        self.shell = rank_shell.RankShell(self.namespace)  # get_ipython() in its cells
        self.wire = Wire(_listen_host(worker), _ssl_context(worker))
        self._lock = threading.Lock()
        self._current: str | None = None
        self._started_at: float | None = None
        self._in_user = False
        self._interrupt_pending = False  # interrupted after taking a cell, before running it
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.console = Console()  # where its cells' output, and their threads', goes
        install_routers(fds=_captures_fds(worker))
        _install_display()
        rank_comms.install(self)  # widgets made on this rank reach the notebook
        self._thread = threading.Thread(target=self._main, name="monarch-engine", daemon=True)
        self._thread.start()

    # -- event loop side ------------------------------------------------------------------
    async def attach(self, comm, controller: str) -> Status:
        """The control comm of ``controller``: tell it where the data path listens, then obey
        interrupt and info until it goes away."""
        channel = self.wire.new_channel(controller, comm)
        await comm.write({"port": self.wire.port, "token": self.wire.token})
        try:
            while True:
                for msg in await comm.read():
                    self._control(channel, msg)
        except (CommClosedError, OSError):
            pass
        finally:
            self.wire.close_channel(channel)
        return Status.dont_reply

    def _control(self, channel: Channel, msg: dict[str, Any]) -> None:
        if msg["op"] == "interrupt":
            self.interrupt(msg.get("target"))
        elif msg["op"] == "info":
            info = self.info(msg.get("about"))
            channel.reply({"ev": "done", "id": msg["id"], "status": "ok", "info": info})
        elif msg["op"] == "comm":  # from the browser, to a widget: not queued behind a cell
            rank_comms.receive(channel.outbox, msg)

    def interrupt(self, cell_id: str | None = None) -> None:
        """Raise KeyboardInterrupt in the running cell (or drop ``cell_id`` if still queued)."""
        with self._lock:
            if cell_id is not None and cell_id != self._current:
                # Still to come (or already done): drop it when it arrives.
                self._cancelled[cell_id] = None
                while len(self._cancelled) > MAX_CANCELLED:
                    self._cancelled.popitem(last=False)
                return
            if self._in_user and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(KeyboardInterrupt)
                )
                session.interrupt_group()  # a child process the cell waits on stops too
            elif self._current is not None:
                # Taken but not yet running (being compiled, say): raised as it starts.
                self._interrupt_pending = True

    def info(self, about: str | None = None) -> dict[str, Any]:
        """The rank's state; ``about`` a request id: whether it runs now, waits in the queue to
        be dropped (interrupted before it started), or neither (done, or never here)."""
        names = [k for k in list(self.namespace) if not k.startswith("_") and k not in IDENTITY]
        with self._lock:
            if about is None:
                state = None
            elif about == self._current:
                state = "running"
            else:
                state = "cancelled" if about in self._cancelled else "unknown"
        return {
            "about": state,
            **self.identity,
            "pid": os.getpid(),
            "host": self.host,
            "device": self.device_info,
            "busy_since": self._started_at,
            "current": self._current,
            "queued": len(self.wire.inbox),
            "names": len(names),
            "collectives": _collectives(),
        }

    # -- the rank's thread ----------------------------------------------------------------
    def _main(self) -> None:
        session.unblock_interrupts()  # for the processes cells start (see session.py)
        while True:
            channel, msg = self.wire.next_request()
            try:
                self._handle(channel, msg)
            except BaseException:
                # An interrupt that arrived just after user code ended: the reply has been sent.
                self._leave_user()

    def _handle(self, channel: Channel, msg: dict[str, Any]) -> None:
        cid = msg["id"]
        with self._lock:
            if cid in self._cancelled:
                del self._cancelled[cid]
                channel.reply({"ev": "done", "id": cid, "status": "cancelled"})
                return
            self._current, self._started_at = cid, time.time()
        reply = {"status": "error", "error": _plain_error("interrupted before it finished")}
        try:
            if msg["op"] == "execute":
                reply = self._execute(channel, msg)
            elif msg["op"] == "call":
                reply = self._call(channel, msg)
            elif msg["op"] == "setup":
                reply = self._setup(msg)
            else:
                reply = {"status": "error", "error": _plain_error(f"unknown op {msg['op']!r}")}
        except Exception as e:
            reply = {"status": "error", "error": self._format_error(e)}
        finally:
            with self._lock:
                self._current = self._started_at = None
                self._interrupt_pending = False
            channel.reply({"ev": "done", "id": cid, **reply})

    def _enter_user(self) -> None:
        with self._lock:
            self._in_user = True
            pending, self._interrupt_pending = self._interrupt_pending, False
        if pending:
            raise KeyboardInterrupt

    def _leave_user(self) -> None:
        while True:
            try:
                with self._lock:
                    self._in_user = False
                    # Clear an interrupt that was sent but not yet delivered.
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(threading.get_ident()), None
                    )
                return
            except KeyboardInterrupt:
                continue

    def _run_user(self, fn) -> tuple[bool, Any]:
        """fn() as user code: interruptible, every exception caught and returned."""
        try:
            try:
                self._enter_user()
                return True, fn()
            finally:
                self._leave_user()
        except BaseException as e:
            self._leave_user()
            return False, e

    def _execute(self, channel: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        code, filename = msg["code"], f"{CELL_PREFIX}{msg.get('n', 0)}>"
        # Tracebacks show the cell as written (``!ls``), not the Python it became.
        source = msg.get("source", code)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(code, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        body = compile(tree, filename, "exec", flags=flags)
        expr = compile(ast.Expression(last.value), filename, "eval", flags=flags) if last else None
        silent = _ends_in_semicolon(source)

        def run():
            self._eval(body)
            return self._eval(expr) if expr is not None else None

        with self.console.running(channel.outbox, msg["id"]), self.as_main():
            ok, value = self._run_user(run)
        channel.outbox.end_cell(msg["id"])
        if not ok:
            return {"status": "error", "error": self._format_error(value)}
        if expr is None or silent:
            return {"status": "ok"}
        return {"status": "ok", **_pack(value)}

    @contextlib.contextmanager
    def as_main(self):
        """This namespace as ``sys.modules["__main__"]`` while a cell runs, as IPython makes its
        own: ``pickle.dumps`` (and torch.save, multiprocessing) of a class defined in a cell
        looks the class up there. Only while a cell runs, not for good: a worker can share its
        process with the notebook (a threads-only cluster) or with other engines, and their
        ``__main__`` must come back. Several running at once: the latest started is __main__,
        and when it ends the one before it again."""
        global _saved_main
        with _mains_lock:
            if not _mains:
                _saved_main = sys.modules.get("__main__")
            _mains.append(self.main)
            sys.modules["__main__"] = self.main
        try:
            yield
        finally:
            with _mains_lock:
                _mains.remove(self.main)
                sys.modules["__main__"] = _mains[-1] if _mains else _saved_main

    def _eval(self, code):
        result = eval(code, self.namespace)
        if code.co_flags & inspect.CO_COROUTINE:
            if self._aloop is None:
                self._aloop = asyncio.new_event_loop()
            result = self._aloop.run_until_complete(result)
        return result

    def _call(self, channel: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        """A controller-side function run against this engine (push, pull, reset, ...)."""
        fn, args = cloudpickle.loads(msg["fn"])
        with self.console.running(channel.outbox, msg["id"]):
            ok, value = self._run_user(lambda: fn(self, *args))
        channel.outbox.end_cell(msg["id"])
        if not ok:
            return {"status": "error", "error": self._format_error(value)}
        return {"status": "ok", **_pack(value)}

    def _setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        identity = {k: msg[k] for k in ("rank", "world_size", "local_rank")}
        identity["host"] = self.host
        self.identity = identity
        rank_comms.widgets_shown(msg.get("widgets", False))
        self.device_info = _device_info(identity["local_rank"])
        if not self.namespace:
            self.reset_namespace()
        else:
            self.namespace.update(self._identity_names())
        return {"status": "ok", "info": self.info()}

    def _identity_names(self) -> dict[str, Any]:
        import torch

        return {
            **self.identity,
            "device": torch.device(self.device_info["torch"]),
            "display": display,
            "get_ipython": self.shell.get_ipython,
        }

    def reset_namespace(self) -> None:
        self.namespace.clear()
        # a fresh module's __name__, __spec__... (multiprocessing reads __main__.__spec__)
        self.namespace.update(vars(types.ModuleType("__main__")))
        self.namespace["__builtins__"] = builtins
        self.namespace.update(self._identity_names())

    def _format_error(self, exc: BaseException) -> dict[str, Any]:
        te = traceback.TracebackException.from_exception(exc)
        # The rank shell's own frames (between a cell's %time line and its code) are noise.
        frames = [f for f in te.stack if f.filename != rank_shell.__file__]
        first = next((i for i, f in enumerate(frames) if f.filename.startswith(CELL_PREFIX)), None)
        if first is None:  # a function sent by the controller (apply): from the user's code on
            first = next((i for i, f in enumerate(frames) if not _ours(f.filename)), len(frames))
        frames = frames[first:]
        if isinstance(exc, KeyboardInterrupt):
            # Where it landed inside our own code (a !cmd's output pump, %monarch run) is
            # noise: the trace ends at the user's line, and is empty for a controller call.
            ours = next((i for i, f in enumerate(frames) if _ours(f.filename)), len(frames))
            frames = frames[:ours]
        te.stack = traceback.StackSummary.from_list(frames)
        lines = "".join(te.format()).rstrip("\n").splitlines()
        evalue = str(exc)
        if isinstance(exc, KeyboardInterrupt) and not evalue:
            evalue = "interrupted"
        return {"ename": type(exc).__name__, "evalue": evalue, "traceback": lines}


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # monarch_nb/


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _captures_fds(worker) -> bool:
    """Whether cells get what is written to fds 1 and 2: those are the whole process's, so only
    in a worker process of its own (one a nanny started), unless MONARCH_NB_CAPTURE_FDS=0."""
    wanted = os.environ.get("MONARCH_NB_CAPTURE_FDS", "1") != "0"
    return wanted and getattr(worker, "nanny", None) is not None


def _listen_host(worker) -> str:
    """The host the worker listens on: every controller that reaches the worker reaches it."""
    hostport = worker.address.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0].strip("[]")


def _ssl_context(worker):
    """The worker's server-side TLS context where the cluster uses TLS, else None."""
    if not worker.address.startswith("tls://"):
        return None
    return worker.security.get_listen_args("worker").get("ssl_context")


def _ends_in_semicolon(code: str) -> bool:
    """Whether the cell's value is hidden: its last token is ``;``, a comment may follow
    (``rank;  # hide``), as IPython decides."""
    from IPython.core.displayhook import DisplayHook

    return DisplayHook.semicolon_at_end_of_expression(code)


def _plain_error(text: str) -> dict[str, Any]:
    return {"ename": "RuntimeError", "evalue": text, "traceback": []}


def _pack(value: Any) -> dict[str, Any]:
    try:
        return {"value": cloudpickle.dumps(value, protocol=5)}
    except Exception as e:
        return {"value_error": f"{type(value).__name__} cannot be pickled: {e}"}


def _collectives() -> int:
    """How many collectives this rank has called on its default process group (-1: none).
    Read from any thread, also while the rank's own thread waits in one."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return -1
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except Exception:  # a backend without the count, a group going away meanwhile: unknown
        return None


def _device_info(local_rank: int) -> dict[str, Any]:
    import psutil
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        props = torch.cuda.get_device_properties(index)
        return {
            "kind": "rocm" if torch.version.hip else "cuda",
            "torch": f"cuda:{index}",
            "name": props.name,
            "memory": props.total_memory,
        }
    return {
        "kind": "cpu",
        "torch": "cpu",
        "name": platform.processor() or platform.machine() or "cpu",
        "memory": psutil.virtual_memory().total,
    }


# -- rich output ----------------------------------------------------------------------------
_original_display = None
_original_clear_output = None


def display(*objs, raw: bool = False, display_id=None, update: bool = False, **kwargs):
    """IPython's display() for cells on a rank: each object's mimebundle goes to the notebook.
    ``display_id=True`` returns a handle whose ``update()`` (or ``update_display``) replaces
    that output in place, as in IPython."""
    cap = current_capture()
    if cap is None:
        if _original_display is None:
            return print(*objs)
        return _original_display(*objs, raw=raw, display_id=display_id, update=update, **kwargs)
    outbox, cell_id = cap
    if display_id is True:
        display_id = f"monarch-{uuid.uuid4().hex}"
    for obj in objs:
        if raw:
            data, metadata = obj, kwargs.get("metadata") or {}
        else:
            data, metadata = _formatter().format(obj)
        ev = {"ev": "display", "id": cell_id, "data": data, "metadata": metadata}
        if display_id is not None:
            ev.update(display_id=display_id, update=update)
        outbox.emit(ev)
    if display_id is not None and not update:
        from IPython.display import DisplayHandle

        return DisplayHandle(display_id)
    return None


def clear_output(wait: bool = False) -> None:
    """IPython's clear_output() for cells on a rank: clears the cell's output in the notebook,
    as it does in a kernel (``wait=True``: once the next output arrives). Where several ranks
    clear together, the notebook clears once."""
    cap = current_capture()
    if cap is None:
        if _original_clear_output is not None:
            _original_clear_output(wait=wait)
        return
    outbox, cell_id = cap
    outbox.emit({"ev": "clear", "id": cell_id, "wait": bool(wait)})


_fmt = None


def _formatter():
    global _fmt
    if _fmt is None:
        from IPython.core.formatters import DisplayFormatter

        _fmt = DisplayFormatter()
        _fmt.formatters["image/png"].for_type_by_name("matplotlib.figure", "Figure", _png)
    return _fmt


def _png(fig) -> bytes | None:
    from IPython.core.pylabtools import print_figure

    return print_figure(fig, "png")


def _install_display() -> None:
    """Make ``from IPython.display import display, clear_output`` in a cell reach the notebook
    too."""
    global _original_display, _original_clear_output
    import IPython.core.display_functions as functions
    import IPython.display

    if functions.display is not display:
        _original_display = functions.display
        functions.display = display
        IPython.display.display = display
    if functions.clear_output is not clear_output:
        _original_clear_output = functions.clear_output
        functions.clear_output = clear_output
        IPython.display.clear_output = clear_output


class EnginePlugin(WorkerPlugin):
    """Gives each worker an Engine (kept across re-registration) and the attach handler.
    ``controller_group`` (host, process group, pid of the controller that registered it): a
    worker process in that group leaves it as it starts (session.py), restarted and
    replacement workers included, before anything is attached."""

    name = PLUGIN_NAME

    def __init__(self, controller_group: tuple[str, int, int] | None = None):
        self.controller_group = controller_group

    def setup(self, worker) -> None:
        session.leave_group(worker, self.controller_group)
        engine = worker.extensions.get("monarch")
        if engine is None:
            os.environ.setdefault("MPLBACKEND", "Agg")
            engine = worker.extensions["monarch"] = Engine(worker)
            global _engine
            _engine = engine
        worker.handlers["monarch_attach"] = engine.attach
