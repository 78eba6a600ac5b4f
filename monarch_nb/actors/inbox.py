"""The receiving ends of the Channels opened in this process, by port id, and where a port's
value that reaches this process goes (ports.py makes them; the worker's dispatch, the
notebook's mailbox and the in-process host hand values in)."""

from __future__ import annotations

import sys
import weakref

receivers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def deliver(msg: dict) -> None:
    """Into the receiver's queue, or one line where it was dropped."""
    receiver = receivers.get(msg.get("port"))
    if receiver is None:
        print(
            "monarch_nb: a value sent to a Port arrived after its receiver was dropped; "
            "it was discarded",
            file=sys.stderr,
            flush=True,
        )
        return
    receiver._put(msg)
