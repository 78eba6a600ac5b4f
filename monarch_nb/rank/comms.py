"""Rank side of widgets: Jupyter comms whose messages travel to the notebook's kernel.

ipywidgets (and tqdm.notebook, which builds on them) open their comms with
``comm.create_comm``. On a rank that makes a ``RankComm``, whose open, msg and close messages,
binary buffers included, are events in the rank's ordered output (so a widget's comm_open
reaches the controller before the display that shows it); comm_relay.py gives each one a twin
in the notebook's kernel. What the browser sends to a twin comes back on the control comm,
which the worker's event loop reads even while a cell runs, and is handled here on a thread of
its own: a cell that loops on ``slider.value`` sees the browser move it.

An ``Output`` widget used as ``with out:`` on a rank collects what the thread prints and
displays into its ``outputs``, as a kernel's Output widget shows it, so ``interact`` shows its
function's output under its controls.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import queue
import sys
import threading
import traceback
from typing import Any

from monarch_nb.rank.capture import current_capture, redirect

logger = logging.getLogger("monarch_nb")

_manager = None  # this process's CommManager, once installed
_engine = None  # this process's engine, whose channels lead to the controllers
_inbox: queue.SimpleQueue = queue.SimpleQueue()  # (outbox, message) from the controllers
_home = threading.local()  # .outbox: where the comm thread's replies go


def _in_kernel() -> bool:
    """Whether this process hosts a Jupyter kernel (a threads-only cluster in the notebook's
    own process): its comms are the kernel's, and widgets there need no relay."""
    kernelbase = sys.modules.get("ipykernel.kernelbase")
    return kernelbase is not None and kernelbase.Kernel.initialized()


def install(engine) -> None:
    """Make comms created on this worker's ranks travel to the controller (idempotent; a no-op
    without the ``comm`` package, or in a process that hosts a kernel)."""
    global _engine, _fallback, _manager
    try:
        import comm
        from comm.base_comm import CommManager
    except ImportError:
        return
    if _in_kernel():
        return
    if _manager is None:
        _engine = engine
        _manager = CommManager()
        thread = threading.Thread(target=_serve, name="monarch-comms", daemon=True)
        # What widget callbacks print goes to the cell running then, or waits for the next.
        thread._monarch_console = engine.console
        thread.start()
    if comm.create_comm is not create_comm:
        _fallback = comm.create_comm
    comm.create_comm = create_comm
    comm.get_comm_manager = get_comm_manager


def widgets_shown(shown: bool) -> None:
    """The controller shows this rank's widgets (it is a Jupyter kernel): ``tqdm.auto`` and
    others that look for a kernel's shell module then choose their widget forms here."""
    if shown and _manager is not None:
        with contextlib.suppress(ImportError):
            importlib.import_module("ipykernel.zmqshell")


def get_comm_manager():
    return _manager


_fallback = None  # comm.create_comm as it was: for comms made outside any rank's cell


def create_comm(*args, **kwargs):
    if _outbox_here() is None:  # not a rank's (a process the notebook's code shares)
        return _fallback(*args, **kwargs)
    if kwargs.get("target_name") == "jupyter.widget":
        _patch_output_widget()
    return _rank_comm_class()(*args, **kwargs)


_RankComm = None


def _rank_comm_class():
    """RankComm, defined once ``comm`` is known to be importable."""
    global _RankComm
    if _RankComm is not None:
        return _RankComm
    from comm.base_comm import BaseComm

    class RankComm(BaseComm):
        """A comm whose peer is its twin in the notebook's kernel."""

        def __init__(self, *args, **kwargs):
            self.outbox = _outbox_here()
            super().__init__(*args, **kwargs)

        def __del__(self):
            # No close from a finaliser: it could run on a thread that holds the outbox's
            # lock (the flusher's), which emitting takes again. A widget closes with close().
            pass

        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            outbox = getattr(_home, "outbox", None) or self.outbox
            cap = current_capture()
            ev = {
                "ev": "comm",
                "id": cap[1] if cap is not None else "",
                "type": msg_type,
                "comm_id": self.comm_id,
                "data": data or {},
                "metadata": metadata or {},
                "buffers": [bytes(b) for b in buffers or ()],
            }
            if msg_type == "comm_open":
                ev["target_name"] = keys.get("target_name") or self.target_name
            outbox.emit(ev)

    _RankComm = RankComm
    return RankComm


def _outbox_here():
    """The outbox of the cell the calling thread prints into (past any Output widget)."""
    cap = current_capture()
    if cap is None:
        outbox = getattr(_home, "outbox", None)  # the comm thread's
        if outbox is None and hasattr(threading.current_thread(), "_monarch_console"):
            # a thread a cell started, between cells: the controller that attached last
            channels = list(_engine.wire.channels.values()) if _engine is not None else []
            outbox = channels[-1].outbox if channels else None
        return outbox
    outbox = cap[0]
    while isinstance(outbox, OutputCapture):
        outbox = outbox.outer[0] if outbox.outer is not None else None
    return outbox


# -- messages from the browser ----------------------------------------------------------------
def receive(outbox, msg: dict[str, Any]) -> None:
    """A comm message from a controller (on the worker's event loop): handled on the comm
    thread, never the loop, since a widget's callbacks run user code."""
    _inbox.put((outbox, msg))


def _serve() -> None:
    while True:
        outbox, msg = _inbox.get()
        _home.outbox = outbox  # replies (request_state, echoes) go back where it came from
        try:
            _handle(outbox, msg)
        except Exception:
            logger.exception("monarch_nb: a widget message failed on this rank")


def _handle(outbox, msg: dict[str, Any]) -> None:
    comm = _manager.get_comm(msg["comm_id"]) if _manager is not None else None
    if comm is None:
        return
    comm.outbox = outbox
    # The shape of a Jupyter message, which comm handlers (ipywidgets') read.
    full = {
        "header": {"msg_type": msg["type"]},
        "parent_header": {},
        "metadata": {},
        "content": {"comm_id": msg["comm_id"], "data": msg.get("data") or {}},
        "buffers": [memoryview(b) for b in msg.get("buffers") or ()],
    }
    if msg["type"] == "comm_close":
        comm._closed = True
        _manager.comms.pop(comm.comm_id, None)
        comm.handle_close(full)
    else:
        comm.handle_msg(full)


# -- Output widgets ---------------------------------------------------------------------------
class OutputCapture:
    """Stands in for a cell's outbox while a thread is inside ``with out:``: what it prints
    and displays becomes the Output widget's ``outputs``."""

    def __init__(self, widget, outer):
        self.widget = widget
        self.outer = outer  # the (outbox, cell id) it stands in for, or None
        self._clear_pending = False

    def _append(self, output: dict[str, Any]) -> None:
        outputs = () if self._clear_pending else tuple(self.widget.outputs)
        self._clear_pending = False
        last = outputs[-1] if outputs else None
        if (
            output["output_type"] == "stream"
            and last is not None
            and last.get("output_type") == "stream"
            and last["name"] == output["name"]
        ):
            outputs = (*outputs[:-1], {**last, "text": last["text"] + output["text"]})
        else:
            outputs = (*outputs, output)
        self.widget.outputs = outputs

    def write(self, cell_id: str, name: str, s: str) -> None:
        self._append({"output_type": "stream", "name": name, "text": s})

    def emit(self, event: dict[str, Any], urgent: bool = False) -> None:
        if event["ev"] == "display":
            data = {k: _jsonable(v) for k, v in event["data"].items()}
            self._append(
                {"output_type": "display_data", "data": data, "metadata": event["metadata"]}
            )
        elif event["ev"] == "clear":
            if event["wait"]:
                self._clear_pending = True
            else:
                self.widget.outputs = ()
        elif self.outer is not None:
            self.outer[0].emit(event, urgent)


def _jsonable(value):
    return base64.b64encode(value).decode() if isinstance(value, bytes) else value


_patched = False


def _patch_output_widget() -> None:
    """``with out:`` on a rank: the thread's output goes to the widget (a kernel's Output
    widget captures by the request's message id, which a rank has none of)."""
    global _patched
    if _patched:
        return
    from ipywidgets import Output

    def __enter__(self):
        stack = self.__dict__.setdefault("_monarch_redirects", [])
        ctx = redirect(OutputCapture(self, current_capture()))
        ctx.__enter__()
        stack.append(ctx)
        return self

    def __exit__(self, etype, evalue, tb):
        if etype is not None:  # shown in the widget, as a kernel shows it, and handled
            text = "".join(traceback.format_exception(etype, evalue, tb))
            OutputCapture(self, None).write("", "stderr", text)
        stack = self.__dict__.get("_monarch_redirects") or []
        if stack:
            stack.pop().__exit__(None, None, None)
        return etype is not None and issubclass(etype, Exception)

    Output.__enter__, Output.__exit__ = __enter__, __exit__
    _patched = True
