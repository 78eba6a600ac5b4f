"""Setting free a rank that waits in a collective whose peer failed.

A rank whose cell raised before a collective leaves the others waiting in it until the group's
timeout (30 s), and neither an interrupt nor the group's own ``abort()``, ``shutdown()`` or
``destroy_process_group()`` ends that wait on gloo while a model still holds the group (a
DistributedDataParallel one does): the waiting thread sits in C++ on a socket. What ends it is
the socket: gloo fails a collective at once when a pair's connection closes. So every group this
process forms records the listening sockets it made (one per gloo group: each pair between two
ranks is a connection accepted on one of theirs), and ``cut()``, run on the worker's event loop
or its accepting thread while the rank's own thread waits, shuts down the connections accepted
on them and those of the group's store. Done on every rank of the cell, that closes every pair
of every group, and each waiting collective raises within milliseconds. The groups are then
useless: the controller forms them again before the next cell.

NCCL's collectives are not set free this way (their wait is on the GPU); ``abort()`` is
NCCL's own way, untried here on a GPU, so not called: an NCCL collective still waits for the
group's timeout (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
from typing import Any

_lock = threading.Lock()
_listeners: set[int] = set()  # ports of the listening sockets process groups made here
_store_ports: set[int] = set()  # the default group's store: rank 0 serves it, the others dial it
_ft_listeners: set[int] = set()  # those of torchft's groups (rank/ft.py), cut on their own too
_installed = False


def track(store_port: int | None = None) -> None:
    """From now on, every process group this process forms has its listening sockets recorded;
    ``store_port``: the port of the store the default group is about to form over."""
    global _installed
    if store_port is not None:
        with _lock:
            _store_ports.add(store_port)
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:  # a torch without it: only the store is cut
        return

    def recording(*args, **kwargs):
        with recorded():
            return helper(*args, **kwargs)

    recording.__wrapped__ = helper
    c10d._new_process_group_helper = recording
    _installed = True


@contextlib.contextmanager
def recorded(ft: bool = False):
    """The listening sockets made within are recorded as a group's; ``ft``: a group of
    torchft's (rank/ft.py: formed again at each new quorum), which ``cut(ft=True)`` cuts alone."""
    before = _listening()
    try:
        yield
    finally:
        made = _listening() - before
        with _lock:
            (_ft_listeners if ft else _listeners).update(made)


def forget() -> None:
    """Every group has gone (``destroy_process_group``): nothing of theirs is left to cut."""
    with _lock:
        _listeners.clear()
        _store_ports.clear()


def cut(ft: bool = False) -> int:
    """Shut down the connections of this process's groups (see the module's docstring); how
    many. Safe from any thread: the sockets stay open (gloo's own), only their traffic ends.
    ``ft``: only torchft's groups' (whose Manager forms new ones at its next quorum)."""
    with _lock:
        listeners, stores = set(_ft_listeners), set()
        if not ft:
            listeners |= _listeners
            stores = set(_store_ports)
    if not listeners and not stores:
        return 0
    done = 0
    for sock in _tcp_sockets():
        with sock:
            try:
                local, remote = sock.getsockname()[1], sock.getpeername()[1]
            except OSError:  # a listener, or not connected
                continue
            if local in listeners or local in stores or remote in stores:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
    return done


def _listening() -> set[int]:
    """The ports this process listens on over TCP."""
    ports = set()
    for sock in _tcp_sockets():
        with sock, contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                ports.add(sock.getsockname()[1])
    return ports


def _tcp_sockets():
    """A duplicate of each TCP socket this process holds (closing it leaves the owner's open),
    read from its own descriptors: the system's whole connection table is never read."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing is recorded, nothing cut
        return
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except (OSError, ValueError):  # closed meanwhile
            continue
        # a socket object made where socket.setdefaulttimeout() was called sets O_NONBLOCK on
        # the file description, which the owner's descriptor shares: its flags are put back
        flags = fcntl.fcntl(dup, fcntl.F_GETFL)
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        fcntl.fcntl(dup, fcntl.F_SETFL, flags)
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            yield sock
        else:
            sock.close()


def collectives() -> int:
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


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up (a peer's connection closed, the group's
    timeout): raised inside torch.distributed, and of the kinds its backends raise. Such a
    group is never used again: the controller forms it afresh."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    text = str(exc)
    inside = f"torch{os.sep}distributed{os.sep}" in where
    return inside and any(word in text for word in _GAVE_UP)


# what gloo and NCCL say when a collective ends without its peers
_GAVE_UP = ("Timed out", "timed out", "Connection closed", "pair closure", "NCCL", "Socket", "peer")


def as_interrupt(exc: BaseException) -> KeyboardInterrupt:
    """The collective failure ``exc`` that an interrupt's ``cut()`` caused, as the interrupt the
    user pressed: where the rank waited, not the closed connection. The cut can end the wait
    before the KeyboardInterrupt raised with it lands (gloo's C code holds that back), which
    then lands in the engine's own code and is dropped (engine.py's ``_leave_user``)."""
    return KeyboardInterrupt().with_traceback(exc.__traceback__)


def released_error(error: dict[str, Any], reason: str) -> dict[str, Any]:
    """A released rank's error: where it was (the frames of what it raised) and why it
    stopped, not the closed connection or KeyboardInterrupt that stopped it."""
    frames = list(error.get("traceback") or [])
    while frames and not frames[-1].startswith(" "):
        frames.pop()  # the exception's own lines
    if not any("<monarch cell" in line for line in frames):
        frames = []  # it stopped in monarch-nb's own code (a script's wait): nothing of the user's
    return {"ename": "Released", "evalue": reason, "traceback": frames}
