"""What a reloaded page is told of the ranks' widgets.

A page that loads (or reloads) a notebook whose kernel already has widgets asks the kernel for
all of their states at once, on ipywidgets' control comm (``jupyter.widget.control``,
``request_states``), and builds the models it is told of; an output that shows any other model
reads "Error displaying widget: model not found". ipywidgets answers with the widgets of the
kernel's own process, and a rank's widget lives in the rank's: its twin here (comm_relay.py)
is only a comm. So the control comm's answer is completed with every twin's last state, as the
twin has seen it go by in both directions. The models the page builds then talk to the twins,
which relay to the ranks as before.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

CONTROL_TARGET = "jupyter.widget.control"
WIDGET_TARGET = "jupyter.widget"


class Relay(Protocol):
    """What is asked of comm_relay.py's ``CommRelay`` here: its twins, each with its state."""

    def twins(self) -> list:
        """The twins of its rank comms."""


_relays: weakref.WeakSet[Relay] = weakref.WeakSet()
_kept: weakref.WeakSet = weakref.WeakSet()  # twins whose cluster went down, still open
_serving = False


def serve(relay: Relay) -> None:
    """Put ``relay``'s twins into the answer a loading page gets (in a Jupyter kernel, where
    the first twin opens)."""
    global _serving
    _relays.add(relay)
    if _serving:
        return
    _serving = True
    try:
        import ipywidgets  # noqa: F401  (first: it registers its own handler, which ours wraps)
    except ImportError:  # the kernel has no ipywidgets: nothing asks on the control comm
        return
    from comm import get_comm_manager

    get_comm_manager().register_target(CONTROL_TARGET, _opened)


def keep(twins: list) -> None:
    """Twins whose cluster went down and that stay open: a page that loads later is told of
    them as of the rest (each is kept while its comm is)."""
    _kept.update(twins)


def _opened(comm, msg) -> None:
    from ipywidgets import Widget

    Widget.handle_control_comm_opened(comm, msg)  # checks the version, answers requests
    send = comm.send

    def send_with_twins(data=None, metadata=None, buffers=None) -> None:
        if isinstance(data, dict) and data.get("method") == "update_states":
            data, buffers = with_twins(data, buffers or [])
        send(data, metadata, buffers)

    comm.send = send_with_twins


def with_twins(data: dict[str, Any], buffers: list) -> tuple[dict[str, Any], list]:
    """ipywidgets' ``update_states`` answer with every twin's model added to it."""
    states = dict(data.get("states") or {})
    paths, buffers = list(data.get("buffer_paths") or []), list(buffers)
    twins = [twin for relay in list(_relays) for twin in relay.twins()] + list(_kept)
    for twin in twins:
        if twin.target_name != WIDGET_TARGET or twin._closed:
            continue
        state, twin_paths, twin_buffers = twin.full_state()
        if "_model_name" not in state:
            continue
        states[twin.comm_id] = {
            "model_name": state["_model_name"],
            "model_module": state.get("_model_module"),
            "model_module_version": state.get("_model_module_version"),
            "state": state,
        }
        paths += [[twin.comm_id, "state", *path] for path in twin_paths]
        buffers += twin_buffers
    return {**data, "states": states, "buffer_paths": paths}, buffers
