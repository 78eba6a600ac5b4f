"""Controller side of widgets on ranks: a twin comm in the notebook's kernel for each rank comm.

A rank's comm events (rank_comms.py) arrive in its ordered output and are handled here on the
controller's reader thread, before the display that follows them reaches the notebook: the twin
opens with the rank comm's id, target, data, metadata and buffers, so the browser builds the
model that the display then shows. What the browser sends to a twin goes to its rank on the
rank's control comm at once.

A kernel runs a cell's messages one at a time, and a ``%%monarch`` cell keeps the kernel's main
thread waiting for the ranks; the browser's messages to twins would wait behind it. Where the
kernel has subshells (ipykernel 7), the twins' messages are routed to a subshell of their own,
a thread that forwards them while the cell runs; elsewhere they reach the ranks once it ends.

A twin whose rank dies or restarts is disconnected: it shows disabled (a progress bar turns
red), answers the browser from the state it last had, and forwards nothing.

When the cluster goes down, each output that showed a rank's widget (given a display id as
it went by) is replaced in place by the widget's last state drawn as static HTML
(widget_static.py): the page, and the notebook saved and reopened, keep the finished bars and
the controls as they were, disabled. The twins stay open (a browser removes the view of a
widget whose comm closes), disabled and answering from their last state: a page that loaded
the notebook after the widget was shown knows no display ids, and keeps its views that way.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from monarch_nb.notebook import widget_states, widget_static

logger = logging.getLogger("monarch_nb")

SUBSHELL_TIMEOUT = 5.0
UPDATE_INTERVAL = 0.1  # seconds between two state updates of one widget sent to the browser
VIEW = "application/vnd.jupyter.widget-view+json"


def _kernel():
    """The Jupyter kernel this process runs, or None (a script, a terminal IPython)."""
    # A kernel has imported ipykernel; importing it here would only cost a script its time.
    kernelbase = sys.modules.get("ipykernel.kernelbase")
    if kernelbase is None:
        return None
    Kernel = kernelbase.Kernel
    return Kernel.instance() if Kernel.initialized() else None


class CommRelay:
    """The twins of one controller's rank comms. ``send(rank, msg)`` puts a message on the
    rank's control comm and says whether the rank is there to take it."""

    def __init__(self, send: Callable[[int, dict], bool]):
        self._send = send
        self._lock = threading.Lock()
        self._twins: dict[str, Any] = {}
        self._subshell: str | None = None
        self._subshell_tried = False
        self._out = threading.RLock()  # keeps each twin's messages in order, held ones too
        self._held: set = set()  # twins with a state update waiting for its turn
        self._timer: threading.Timer | None = None

    @staticmethod
    def shows_widgets() -> bool:
        """Whether a rank's widgets will show: this process is a Jupyter kernel."""
        return _kernel() is not None

    def deliver(self, rank: int, ev: dict[str, Any]) -> None:
        """A rank's comm event (on the reader thread, which must not die of it)."""
        try:
            self._deliver(rank, ev)
        except Exception:
            logger.exception("monarch_nb: cannot relay rank %d's widget message", rank)

    def _deliver(self, rank: int, ev: dict[str, Any]) -> None:
        comm_id = ev["comm_id"]
        if ev["type"] == "comm_open":
            if _kernel() is None:
                return
            self._ensure_subshell()
            widget_states.serve(self)  # a reloaded page is told of the twins' models
            twin = _twin_class()(self, rank, comm_id, ev["target_name"], ev["data"], ev["buffers"])
            with self._lock:
                self._twins[comm_id] = twin
            twin.open(data=ev["data"], metadata=ev["metadata"], buffers=ev["buffers"])
            return
        with self._lock:
            twin = self._twins.get(comm_id)
            if ev["type"] == "comm_close":
                self._twins.pop(comm_id, None)
        if twin is None:
            return
        data = ev["data"]
        with self._out:
            if ev["type"] == "comm_msg":
                twin.note(data, ev["buffers"])
                if not ev["buffers"] and self._hold(twin, data):
                    return
            self._send_held(twin)
            if ev["type"] == "comm_close":
                twin.close(data=data, metadata=ev["metadata"], buffers=ev["buffers"])
            else:
                twin.send(data=data, metadata=ev["metadata"], buffers=ev["buffers"])

    def displayed(self, ev: dict[str, Any]) -> None:
        """A rank's display event (on the reader thread, before it is shown): one that shows a
        rank's widget gets a display id, kept by the widget's twin, so that ``close`` can put
        the widget's last picture in its place."""
        view = (ev.get("data") or {}).get(VIEW)
        model_id = view.get("model_id") if isinstance(view, dict) else None
        with self._lock:
            twin = self._twins.get(model_id)
        if twin is None:
            return
        if not ev.get("display_id"):
            ev["display_id"], ev["update"] = f"monarch-widget-{uuid.uuid4().hex}", False
        twin.displays.add(ev["display_id"])

    # -- a rank that sets a widget's value in a tight loop ------------------------------------
    def _hold(self, twin, data: dict[str, Any]) -> bool:
        """Whether a plain state update waits, merged with the others that came meanwhile:
        one goes to the browser per UPDATE_INTERVAL per widget, the latest state last."""
        if data.get("method") != "update" or data.get("buffer_paths"):
            return False
        now = time.monotonic()
        if twin.held is None and now - twin.sent_at >= UPDATE_INTERVAL:
            twin.sent_at = now
            return False
        if twin.held is None:
            twin.held = {"method": "update", "state": {}, "buffer_paths": []}
            self._held.add(twin)
        twin.held["state"].update(data.get("state") or {})
        if self._timer is None:
            self._timer = threading.Timer(UPDATE_INTERVAL, self.flush)
            self._timer.daemon = True
            self._timer.start()
        return True

    def _send_held(self, twin) -> None:
        if twin.held is not None:
            held, twin.held = twin.held, None
            self._held.discard(twin)
            twin.sent_at = time.monotonic()
            twin.send(data=held)

    @property
    def holding(self) -> bool:
        """Whether updates are held (rarely: a cell's end flushes only then)."""
        return bool(self._held)

    def flush(self) -> None:
        """Send the held updates now (their time has come, or a cell ended: its widgets
        show their last state before the cell's end)."""
        with self._out:
            self._timer = None
            for twin in list(self._held):
                try:
                    self._send_held(twin)
                except Exception:
                    logger.exception("monarch_nb: cannot relay a widget's update")

    def twins(self) -> list:
        with self._lock:
            return list(self._twins.values())

    def forward(self, twin, msg: dict[str, Any]) -> None:
        """The browser's message to ``twin`` (on the kernel's thread that dispatched it)."""
        content = msg.get("content", {})
        kind = msg.get("header", {}).get("msg_type", "comm_msg")
        buffers = [bytes(b) for b in msg.get("buffers") or ()]
        if kind == "comm_msg" and not twin.dead:  # a dead twin answers with its last state
            twin.note(content.get("data"), buffers)  # a slider moved: the twin's state too
        if kind == "comm_close":
            with self._lock:
                self._twins.pop(twin.comm_id, None)
        if not twin.dead:
            sent = self._send(
                twin.rank,
                {
                    "op": "comm",
                    "type": kind,
                    "comm_id": twin.comm_id,
                    "data": content.get("data") or {},
                    "buffers": buffers,
                },
            )
            if sent:
                return
            twin.dead = True
        if kind == "comm_msg":
            twin.answer_dead(content.get("data") or {})

    def lost(self, rank: int) -> None:
        """``rank``'s worker is gone (it died, or restarts): its twins are disconnected."""
        with self._lock:
            twins = [t for t in self._twins.values() if t.rank == rank and not t.dead]
        for twin in twins:
            twin.dead = True
            try:
                twin.show_disconnected()
            except Exception:
                logger.exception("monarch_nb: cannot mark rank %d's widget disconnected", rank)

    def close(self) -> None:
        """The cluster goes down: every widget shown keeps its last state as a static picture
        in its output, and every twin stays open, finished (disabled, answering from its last
        state), for the pages that show it live."""
        with self._out:
            if self._timer is not None:
                self._timer.cancel()
        self.flush()  # the last state reaches the views that stay
        with self._lock:
            twins, self._twins = list(self._twins.values()), {}
        self._freeze(twins)
        for twin in twins:
            try:
                twin.finish()
            except Exception:
                logger.exception("monarch_nb: cannot mark a rank's widget finished")
        widget_states.keep(twins)  # a page loaded later is told of them too
        self._delete_subshell()

    @staticmethod
    def _freeze(twins: list) -> None:
        """Each output that shows a twin's widget replaced by its picture."""
        from IPython.display import update_display

        by_id = {twin.comm_id: twin for twin in twins}

        def states(model_id: str) -> dict[str, Any] | None:
            twin = by_id.get(model_id)
            return twin.state if twin is not None else None

        for twin in twins:
            if not twin.displays:
                continue
            try:
                picture = widget_static.bundle(twin.comm_id, states)
                for display_id in sorted(twin.displays):
                    update_display(picture, raw=True, display_id=display_id)
            except Exception:
                logger.exception("monarch_nb: cannot keep rank %d's widget", twin.rank)

    # -- the subshell that takes the twins' messages while a cell runs -----------------------
    @property
    def subshell(self) -> str | None:
        return self._subshell

    def _ensure_subshell(self) -> None:
        """Made before the first twin opens, off the shell channel thread that routes."""
        with self._lock:
            if self._subshell_tried:
                return
            self._subshell_tried = True
        self._subshell = self._on_shell_channel(lambda manager: manager._create_subshell())

    def _delete_subshell(self) -> None:
        subshell, self._subshell = self._subshell, None
        self._subshell_tried = False
        if subshell is not None:
            self._on_shell_channel(lambda manager: manager._delete_subshell(subshell))

    @staticmethod
    def _on_shell_channel(fn):
        """``fn(subshell manager)`` on the kernel's shell channel thread, which owns the
        subshells; None where the kernel has none, or routes no comm to one."""
        from ipykernel.comm.comm import BaseComm

        kernel = _kernel()
        thread = getattr(kernel, "shell_channel_thread", None)
        if thread is None or not hasattr(BaseComm, "_reply_subshell_for"):
            return None
        done, out = threading.Event(), {}

        def run():
            try:
                out["value"] = fn(thread.manager)
            except Exception:
                logger.exception("monarch_nb: no subshell for widgets on ranks")
            finally:
                done.set()

        thread.io_loop.add_callback(run)
        done.wait(SUBSHELL_TIMEOUT)
        return out.get("value")


_Twin = None


def _twin_class():
    """The twin comm class, defined once ipykernel is known to be importable."""
    global _Twin
    if _Twin is not None:
        return _Twin
    from ipykernel.comm.comm import BaseComm

    class Twin(BaseComm):
        """The notebook kernel's end of one rank comm."""

        def __init__(self, relay: CommRelay, rank: int, comm_id: str, target: str, data, buffers):
            self.relay, self.rank, self.dead = relay, rank, False
            self.marked = False  # shown as disconnected
            self.held: dict[str, Any] | None = None  # a state update waiting for its turn
            self.sent_at = 0.0  # when the last state update went to the browser
            self.displays: set[str] = set()  # the display ids of the outputs showing it
            self.state: dict[str, Any] = {}  # the model's last state, buffers left out
            self.buffers: dict[tuple, bytes] = {}  # and those, by their path in the state
            self.note(data, buffers)
            super().__init__(target_name=target, comm_id=comm_id, primary=False)
            self.on_msg(lambda msg: relay.forward(self, msg))
            self.on_close(lambda msg: relay.forward(self, msg))

        def _reply_subshell_for(self, data, default):
            return self.relay.subshell or default

        def note(self, data, buffers=()) -> None:
            """Keep the state that ``data`` (a message either way) sets."""
            if not (isinstance(data, dict) and isinstance(data.get("state"), dict)):
                return
            paths = [tuple(p) for p in data.get("buffer_paths") or () if p]
            given = set(data["state"]) | {p[0] for p in paths}
            self.buffers = {p: b for p, b in self.buffers.items() if p[0] not in given}
            self.buffers.update(zip(paths, (bytes(b) for b in buffers), strict=False))
            self.state.update(data["state"])

        def full_state(self) -> tuple[dict[str, Any], list[list], list[bytes]]:
            """The model's last state, its buffers' paths and its buffers."""
            return dict(self.state), [list(p) for p in self.buffers], list(self.buffers.values())

        def _disconnected(self) -> dict[str, Any]:
            change = {}
            if "disabled" in self.state:
                change["disabled"] = True
            if "bar_style" in self.state:
                change["bar_style"] = "danger"
            description = self.state.get("description")
            if "disabled" in self.state and isinstance(description, str):
                # (a tooltip is no help: views without a description fail to show one)
                change["description"] = f"{description} (rank {self.rank} gone)".lstrip()
            return change

        def show_disconnected(self) -> None:
            if self.marked:
                return
            self.marked = True
            change = self._disconnected()
            if change:
                self.state.update(change)
                self.send({"method": "update", "state": change, "buffer_paths": []})

        def finish(self) -> None:
            """Its cluster went down: it stays as it was, disabled where it can be, and answers
            the browser from this last state."""
            self.dead = self.marked = True
            if self.state.get("disabled") is False:
                self.state["disabled"] = True
                self.send({"method": "update", "state": {"disabled": True}, "buffer_paths": []})

        def answer_dead(self, data: dict[str, Any]) -> None:
            """The browser spoke to a disconnected widget: it gets the last state back (a
            state request is answered, so that a page reload does not wait for a dead rank)."""
            self.show_disconnected()
            state, paths, buffers = self.full_state()
            self.send({"method": "update", "state": state, "buffer_paths": paths}, buffers=buffers)

    _Twin = Twin
    return Twin
