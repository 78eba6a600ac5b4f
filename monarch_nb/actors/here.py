"""Which actor host this process is, and the mailbox it sends from.

A worker's ``ActorHost`` (worker.py) registers itself here as its plugin sets up; the notebook's
side (caller.py) fills ``client_mailbox``, the current controller's mailbox. Modules that only
need to know where they run (ports.py, rdma.py) ask here, and import neither.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

# The address of this process's own actors (this_proc() of a notebook or script: inprocess.py)
IN_PROCESS = f"inproc://{socket.gethostname()}/{os.getpid()}"

_host: Any = None  # this worker's ActorHost; None outside a worker
# () -> the current controller's Mailbox, or None where no cluster is up (set by caller.py)
client_mailbox: Callable[[], Any] = lambda: None  # noqa: E731


def current_host():
    """This process's ActorHost when it is a monarch worker, else None."""
    return _host


def set_host(host) -> None:
    global _host
    _host = host


def sending_mailbox():
    """Where this process sends actor messages from: its worker's mailbox, or the notebook's
    controller's (None where neither is)."""
    return _host.mailbox if _host is not None else client_mailbox()


def address() -> str:
    """This process's actor address: its worker's, or the in-process host's."""
    return _host.worker.address if _host is not None else IN_PROCESS
