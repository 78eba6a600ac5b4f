"""Worker side of a rank: its namespace, the thread that runs its cells, output, interrupt.

A controller opens a comm straight to the worker's ``monarch_attach`` handler and keeps it for
control: ``interrupt`` and ``info`` are answered on the worker's event loop at once, even while
a cell runs. Cells and calls travel on the data path of engine_io.py, read by the rank's own
thread, which runs them one at a time; a long cell never blocks the event loop (heartbeats keep
flowing).
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import ctypes
import inspect
import os
import socket
import sys
import threading
import time
import types
from typing import Any

import cloudpickle
from distributed import WorkerPlugin
from distributed.comm import CommClosedError
from distributed.core import Status

from monarch_nb.rank import autoreload as rank_autoreload
from monarch_nb.rank import children, debugger, session, worker_logs
from monarch_nb.rank import comms as rank_comms
from monarch_nb.rank import device as rank_device
from monarch_nb.rank import ft as rank_ft
from monarch_nb.rank import interrupting as rank_interrupting
from monarch_nb.rank import mesh as rank_mesh
from monarch_nb.rank import profiling as rank_profiling
from monarch_nb.rank import release as rank_release
from monarch_nb.rank import shell as rank_shell
from monarch_nb.rank import stacks as rank_stacks
from monarch_nb.rank import sync as rank_sync
from monarch_nb.rank.capture import Console, install_routers
from monarch_nb.rank.cells import compile_cell, format_error, pack, plain_error
from monarch_nb.rank.display import display, install_display
from monarch_nb.rank.engine_io import Channel, Wire
from monarch_nb.wire import sent_after

PLUGIN_NAME = "monarch-engine"
# Set before every cell and call: a cell's `rank = 5` or `del mesh` lasts that cell only, so
# that every later cell, on every rank, reads the rank's own (docs/magics-and-output.md)
PER_CELL = ("rank", "world_size", "local_rank", "host", "device", "mesh")
# and these once, as IPython sets them: a cell may define a display() of its own for later cells
IDENTITY = (*PER_CELL, "display", "get_ipython")
MAX_CANCELLED = 1024  # ids of interrupted-before-they-ran requests remembered


_engine: Engine | None = None  # the engine of this worker process, once it has one

# The namespaces of the cells running here, latest last, and the __main__ they stand in for
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
        # torch imported already (a worker forked from the forkserver) is the loop's thread's,
        # else the rank's thread imports it: where the profiler first starts (rank/profiling.py)
        self.torch_on_loop = "torch" in sys.modules
        self.host = socket.gethostname()
        self.identity: dict[str, Any] = {}
        self.device_info: dict[str, Any] = {}
        self.mesh = None  # the DeviceMesh the controller had built (mesh.py)
        self.mesh_coords: dict[str, str] = {}  # this rank's place in it: {"dp": "1", "tp": "0"}
        self.user_labels: dict[str, str] = {}  # monarch_nb.label() (labels.py)
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
        self._interrupt_sent = False  # a KeyboardInterrupt raised in the thread, maybe not landed
        # requests interrupted before they ran, and the release that dropped them, if one did
        self._cancelled: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._interrupts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._released: dict[str, str] = {}  # the running cell, if another rank's failure ended it
        self._cut: str | None = None  # the running cell, if its interrupt cut its groups too
        self._aloop: asyncio.AbstractEventLoop | None = None
        self.failure = None  # (request id, exception, traceback) of the last failed cell
        self.reloader: rank_autoreload.Reloader | None = None  # %monarch autoreload on
        self.console = Console()  # where its cells' output, and their threads', goes
        install_routers(fds=_captures_fds(worker))
        install_display()
        rank_comms.install(self)  # widgets made on this rank reach the notebook
        debugger.install()  # input(), getpass and pdb of its cells ask the notebook
        # Ctrl-C from a controller on this host, past both event loops (engine_io.Wire._hello)
        self.wire.on_interrupt = self._interrupt_msg
        self._thread = threading.Thread(target=self._main, name="monarch-engine", daemon=True)
        self._thread.start()

    # -- event loop side ------------------------------------------------------------------
    async def attach(self, comm, controller: str) -> Status:
        """The control comm of ``controller``: tell it where the data path listens, then obey
        interrupt and info until it goes away."""
        channel = self.wire.new_channel(controller, comm)
        await comm.write({**self.wire.listeners.hello(), "token": self.wire.token})
        try:
            while True:
                for msg in await comm.read():
                    self._control(channel, msg)
        except (CommClosedError, OSError):
            pass
        finally:
            self.wire.close_channel(channel)
            rank_sync.forget(self, controller)  # its synced code goes with it
        return Status.dont_reply

    def _control(self, channel: Channel, msg: dict[str, Any]) -> None:
        if msg["op"] == "interrupt":
            self._interrupt_msg(msg)
        elif msg["op"] == "info":
            info = self.info(msg.get("about"), msg.get("press"))
            channel.reply({"ev": "done", "id": msg["id"], "status": "ok", "info": info})
        elif msg["op"] == "comm":  # from the browser, to a widget: not queued behind a cell
            rank_comms.receive(channel.outbox, msg)
        elif msg["op"] == "stacks":  # %monarch stacks: this thread may be blocked in C
            rank_stacks.answer(self, channel, msg)
        elif msg["op"] == "ft":  # which ranks a fault-tolerant cell still waits for
            rank_ft.told(msg)

    def _interrupt_msg(self, m: dict[str, Any]) -> None:
        self.interrupt(m.get("target"), m.get("sent"), m.get("key"), m.get("release"), m.get("cut"))

    def interrupt(
        self,
        cell_id: str | None = None,
        sent: str | None = None,
        key: str | None = None,
        release: str | None = None,
        cut: str | None = None,
    ) -> None:
        """Raise KeyboardInterrupt in the running cell (or drop ``cell_id`` if still queued).
        ``sent``: the newest request its controller had sent when it asked; one it sent later
        is spared (the interrupt came on the control comm, behind it). ``key``: the press it
        stands for, which arrives by two paths (wire.py's ``interrupt_here``) and acts once;
        the request it hit is kept under it for ``info``. ``release``: why another rank's
        failure stops this cell, which it then reports; ``cut``: what to end first, even on a
        rank whose cell is done ("group": its process groups' connections, "ft": torchft's
        only, "children": its child processes; release.py)."""
        with self._lock:
            if key is not None:
                if key in self._interrupts:
                    return
                self._interrupts[key] = None
                while len(self._interrupts) > MAX_CANCELLED:
                    self._interrupts.popitem(last=False)
                self._interrupts[key] = self._hit(cell_id, sent)
            hit = self._current is not None and self._hit(cell_id, sent) == self._current
            if hit and release is not None:
                self._released[self._current] = release
            elif hit and cut in ("group", "ft"):
                self._cut = self._current
        if cut in ("group", "ft"):
            rank_release.cut(ft=cut == "ft")
        elif cut == "children":
            children.terminate_all()
        with self._lock:
            if cell_id is None and sent is not None and sent_after(self._current, sent):
                return
            if cell_id is not None and cell_id != self._current:
                # Still to come (or already done): drop it when it arrives.
                self._cancelled[cell_id] = release
                while len(self._cancelled) > MAX_CANCELLED:
                    self._cancelled.popitem(last=False)
                return
            if self._in_user and self._thread.ident is not None:
                target = self._current
                if not self._raise(target, force=False):  # the thread is importing
                    rank_interrupting.later(lambda force: self._raise(target, force, lock=True))
            elif self._current is not None:
                # Taken but not yet running (being compiled, say): raised as it starts.
                self._interrupt_pending = True

    def _raise(self, target: str | None, force: bool, lock: bool = False) -> bool:
        """KeyboardInterrupt in the rank's thread while ``target`` runs user code there, unless
        it is importing and not ``force``d (interrupting.py); False where it waits for that."""
        with self._lock if lock else contextlib.nullcontext():
            ident = self._thread.ident
            if not (self._in_user and self._current == target and ident is not None):
                return True  # done, or not in user code any more: nothing to stop
            if not force and rank_interrupting.importing(ident):
                return False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt)
            )
            self._interrupt_sent = True
            session.interrupt_group()  # a child process the cell waits on stops too
            return True

    def _hit(self, cell_id: str | None, sent: str | None) -> str | None:
        """The request an interrupt asked now stops: the running one unless it is spared."""
        if cell_id is not None and cell_id != self._current:
            return None
        if cell_id is None and sent is not None and sent_after(self._current, sent):
            return None
        return self._current

    @property
    def labels(self) -> dict[str, str]:
        """What the panel, the sidebar and ``%monarch status`` show beside the rank's number."""
        return {**self.mesh_coords, **self.user_labels}

    @property
    def busy_since(self) -> float | None:
        """When the request the rank's thread runs now started (None: idle)."""
        return self._started_at

    @property
    def busy(self) -> bool:
        """Whether the rank's thread runs a request now (telemetry samples it at full rate)."""
        return self._current is not None

    def info(self, about: str | None = None, press: str | None = None) -> dict[str, Any]:
        """The rank's state; ``about`` a request id: whether it runs now, waits in the queue to
        be dropped (interrupted before it started), or neither (done, or never here); ``press``
        an interrupt's key: the request it stopped (``hit``; None if it found none running)."""
        names = [k for k in list(self.namespace) if not k.startswith("_") and k not in IDENTITY]
        with self._lock:
            if about is None:
                state = None
            elif about == self._current:
                state = "running"
            else:
                state = "cancelled" if about in self._cancelled else "unknown"
            hit = self._interrupts.get(press) if press is not None else None
        return {
            "about": state,
            **self.identity,
            "pid": os.getpid(),
            "host": self.host,
            "device": self.device_info,
            "busy_since": self._started_at,
            "current": self._current,
            "hit": hit,
            "queued": len(self.wire.inbox),
            "names": len(names),
            "collectives": rank_release.collectives(),
            "labels": self.labels,
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
        if msg["op"] == "input_reply":
            return  # answers an input() that an interrupt ended before the answer came
        cid = msg["id"]
        with self._lock:
            if cid in self._cancelled:
                released = self._cancelled.pop(cid)
                done = {"status": "cancelled"}
                if released is not None:  # another rank failed before this one started it
                    done = {"status": "error", "error": rank_release.released_error({}, released)}
                channel.reply({"ev": "done", "id": cid, **done})
                return
            self._current, self._started_at = cid, time.time()
        reply = {"status": "error", "error": plain_error("interrupted before it finished")}
        try:
            with debugger.serving(self.wire, channel, cid, self.identity.get("rank")):
                reply = self._run_op(channel, msg)
        except Exception as e:
            reply = {"status": "error", "error": format_error(e)}
        finally:
            with self._lock:
                self._current = self._started_at = self._cut = None
                self._interrupt_pending = False
                released = self._released.pop(cid, None)
            if released is not None and reply["status"] == "error":
                reply = {**reply, "error": rank_release.released_error(reply["error"], released)}
            channel.reply({"ev": "done", "id": cid, **reply})

    def _run_op(self, channel: Channel, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["op"] in ("execute", "call") and self.identity:
            self.namespace.update(self._identity_names(PER_CELL))
        if msg["op"] == "execute":
            return self._execute(channel, msg)
        if msg["op"] == "call":
            return self._call(channel, msg)
        if msg["op"] == "setup":
            return self._setup(msg)
        return {"status": "error", "error": plain_error(f"unknown op {msg['op']!r}")}

    def _enter_user(self) -> None:
        with self._lock:
            self._in_user = True
            pending, self._interrupt_pending = self._interrupt_pending, False
        if pending:
            raise KeyboardInterrupt

    def _leave_user(self) -> None:
        """Out of user code: no interrupt is raised in the thread from here on, and one raised
        that has not landed yet lands here and is dropped. Never cleared with
        ``PyThreadState_SetAsyncExc(id, NULL)``: on CPython 3.11 that leaves the eval breaker
        set for good, and a thread under a profile or trace function spins at its next call."""
        while True:
            try:
                with self._lock:
                    self._in_user = False
                    sent, self._interrupt_sent = self._interrupt_sent, False
                if sent:
                    _land()
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
        body, expr, silent = compile_cell(msg)

        def run():
            self._eval(body)
            return self._eval(expr) if expr is not None else None

        reloading = msg.get("autoreload", False)
        with self.console.running(channel.outbox, msg["id"]), self.as_main():
            if reloading and self.reloader is None:  # a rank that restarted: on again
                self.reloader = rank_autoreload.Reloader()
            failed = self.reloader.before_cell() if reloading else None
            if failed is None:
                profile, loop = msg.get("profile"), self.loop if self.torch_on_loop else None
                with rank_profiling.profiled(profile, channel.outbox, msg["id"], loop):
                    ok, value = self._run_user(run)
        channel.outbox.end_cell(msg["id"])
        if failed is not None:
            return {"status": "error", "error": failed}
        if reloading:
            self.reloader.after_cell()
        if not ok:
            debugger.keep_failure(self, msg["id"], value)
            gave_up = rank_release.collective_failure(value)  # its group is formed afresh
            if gave_up and self._cut == msg["id"]:  # the interrupt's cut ended the wait
                value = rank_release.as_interrupt(value)
            return {"status": "error", "error": format_error(value), "collective": gave_up}
        if expr is None or silent:
            return {"status": "ok"}
        return {"status": "ok", **pack(value)}

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
            return {"status": "error", "error": format_error(value)}
        return {"status": "ok", **pack(value)}

    def _setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        identity = {k: msg[k] for k in ("rank", "world_size", "local_rank")}
        identity["host"] = self.host
        self.identity = identity
        os.environ.update(msg.get("env") or {})  # the cluster's (--ft: where the Lighthouse is)
        rank_comms.widgets_shown(msg.get("widgets", False))
        self.device_info = rank_device.describe(identity["local_rank"])
        if not self.namespace:
            self.reset_namespace()
        else:
            self.namespace.update(self._identity_names())
        return {"status": "ok", "info": self.info()}

    def _identity_names(self, names=IDENTITY) -> dict[str, Any]:
        import torch

        every = {
            **self.identity,
            "device": torch.device(self.device_info["torch"]),
            "mesh": rank_mesh.current(self),
            "display": display,
            "get_ipython": self.shell.get_ipython,
        }
        return {k: every[k] for k in names}

    def reset_namespace(self) -> None:
        self.namespace.clear()
        # a fresh module's __name__, __spec__... (multiprocessing reads __main__.__spec__)
        self.namespace.update(vars(types.ModuleType("__main__")))
        self.namespace["__builtins__"] = builtins
        self.namespace.update(self._identity_names())


def _land() -> None:
    """A call of a Python function, at whose start a pending asynchronous exception is raised."""


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


class EnginePlugin(WorkerPlugin):
    """Gives each worker an Engine (kept across re-registration) and the attach handler.
    ``controller_group`` (host, process group, pid of the controller that registered it): a
    worker process in that group leaves it as it starts (session.py), restarted and
    replacement workers included, before anything is attached."""

    name = PLUGIN_NAME

    def __init__(self, controller_group: tuple[str, int, int] | None = None):
        self.controller_group = controller_group

    def setup(self, worker) -> None:
        if session.leave_group(worker, self.controller_group):  # writes to the kernel's stderr
            worker_logs.quiet_ending(worker)
        engine = worker.extensions.get("monarch")
        if engine is None:
            os.environ.setdefault("MPLBACKEND", "Agg")
            engine = worker.extensions["monarch"] = Engine(worker)
            global _engine
            _engine = engine
        worker.handlers["monarch_attach"] = engine.attach
