"""Reaching a Dask scheduler in bounded time and memory, or one line saying what answered instead.

Dask's own client does neither. ``Client(address, timeout=8)`` bounds the TCP connection, not the
handshake after it (deliberately, says distributed.comm.tcp), so a port that accepts and never
speaks (the dashboard's 8787 typed for the scheduler's 8786, any HTTP server) held ``%monarch
connect`` for as long as it stayed open. And Dask's TCP comm allocates, then waits for, whatever
size a peer's first 8 bytes claim: an SSH banner (``SSH-2.0-``) claims 2.82 EiB, refused by numpy
only because it is absurd, while a peer that claims 4 GiB gets them. A Client that failed was left
to its ``__del__``, which at a script's exit waited out twice its timeout.

So ``check`` shakes hands first, on an event loop of its own within the timeout, with what this
process's Dask comms read before a handshake bounded (``bound_dask_handshakes``, MAX_HANDSHAKE
bytes, on every Dask TCP and TLS comm of the process: the kernel's, the kept cluster's host's,
the Jupyter server's), and ``client`` closes a Client that failed to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import struct
import threading
import time
from typing import Any

from distributed.comm import CommClosedError

from monarch_nb.wire import MAX_HANDSHAKE, claim

SLACK = 0.5  # seconds past the timeout: Dask's connect says why it failed first, if it can
ASK_HTTP = 1.0  # seconds an address that sent no handshake gets to answer an HTTP request
DASHBOARD = "it speaks HTTP: is it the dashboard? the scheduler is usually on 8786"


class NotDask(CommClosedError):
    """A peer whose first message is no Dask handshake: it claims more than MAX_HANDSHAKE bytes
    (an SSH banner, an HTTP answer, garbage) or cannot be read. A CommClosedError, so that a
    Dask listener logs one line for it, not a traceback. ``first``: its first 8 bytes, where
    they claimed too much."""

    def __init__(self, why: str, first: bytes = b""):
        super().__init__(why)
        self.first = first


# What a Dask comm's read may still take before its handshake, in the task that reads it
_left: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("monarch_nb_left")
_bounding = threading.Lock()
_bounded = False


def bound_dask_handshakes() -> None:
    """Bound what this process's Dask TCP and TLS comms read before their handshake, either way
    (a client's connect, a scheduler's listener): a first message may claim MAX_HANDSHAKE bytes
    at most, else NotDask, before anything is allocated for it; one that Dask cannot read is
    NotDask too. What comes after the handshake is Dask's own. Idempotent."""
    global _bounded
    from distributed.comm import tcp

    with _bounding:
        if _bounded:
            return
        read, read_bytes_rw = tcp.TCP.read, tcp.read_bytes_rw

        async def read_bounded(self, deserializers=None):
            if self.remote_info:  # the handshake set it
                return await read(self, deserializers)
            token = _left.set([MAX_HANDSHAKE])  # what tcp.read_bytes_rw sees in this task
            try:
                return await read(self, deserializers)
            except (CommClosedError, asyncio.CancelledError):
                raise
            except Exception as e:  # what Dask made of a stranger's bytes
                raise NotDask(f"its first message is no Dask handshake ({e!r:.200})") from None
            finally:
                _left.reset(token)

        async def read_bytes_bounded(stream, n: int):
            left = _left.get(None)
            if left is not None:
                if n > left[0]:
                    first = struct.pack("Q", n) if left[0] == MAX_HANDSHAKE else b""
                    raise NotDask(claim(first, n, MAX_HANDSHAKE), first)
                left[0] -= n
            return await read_bytes_rw(stream, n)

        tcp.TCP.read, tcp.read_bytes_rw = read_bounded, read_bytes_bounded
        _bounded = True


def check(address: str, timeout: float, connection_args: dict[str, Any]) -> str | None:
    """None once a Dask listener at ``address`` has shaken hands within ``timeout`` seconds;
    else why not, in one line: nothing listens there, or what does is no Dask scheduler. Other
    failures (TLS settings) return None too: the Client says what they are, as it did."""
    bound_dask_handshakes()
    box: dict[str, BaseException] = {}
    done = threading.Event()

    def shake() -> None:
        try:
            asyncio.run(_shake(address, timeout, connection_args))
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=shake, name="monarch-handshake", daemon=True).start()
    if not done.wait(timeout + SLACK + 2):  # a name that takes that long to resolve
        return f"cannot reach a Dask scheduler at {address} within {timeout:g} s"
    error = box.get("error")
    if isinstance(error, NotDask):
        return not_a_scheduler(address, said(error))
    if isinstance(error, NotScheduler):
        return not_a_scheduler(address, str(error))
    if isinstance(error, TimeoutError):  # connected, and no handshake came (before OSError)
        return _silent(address, timeout)
    if isinstance(error, CommClosedError):
        return not_a_scheduler(address, _closed(address))
    if isinstance(error, OSError):
        return f"cannot reach a Dask scheduler at {address}: {error}"
    return None


def not_a_scheduler(address: str, why: str) -> str:
    return f"{address} answered, but not as a Dask scheduler ({why})"


class NotScheduler(Exception):
    """A Dask process, but not a scheduler: a worker or a nanny."""


async def _shake(address: str, timeout: float, connection_args: dict[str, Any]) -> None:
    await asyncio.wait_for(_identify(address, timeout, connection_args), timeout + SLACK)


async def _identify(address: str, timeout: float, connection_args: dict[str, Any]) -> None:
    """Shake hands, and ask what answered: a worker's address passes the handshake, then the
    Client failed with ``TypeError: Worker.identity() got an unexpected keyword argument``."""
    from distributed.comm import connect

    comm = await connect(address, timeout=timeout, **connection_args)
    try:
        # what every Dask server answers (the Client's n_workers=0 fails on a worker, in its log)
        await comm.write({"op": "identity", "reply": True})
        answer = await comm.read()
    finally:
        await comm.close()
    answer = answer if isinstance(answer, dict) else {}
    if "workers" in answer:  # a scheduler's
        return
    kind = str(answer.get("type", "process")).lower()
    of = f", of the scheduler at {answer['scheduler']}" if answer.get("scheduler") else ""
    raise NotScheduler(f"it is a Dask {kind}{of}: connect to its scheduler")


def said(error: NotDask) -> str:
    """What a peer's first bytes say it is (Dask's rpc raises a NotDask of its own words from
    ours: ours is read)."""
    while isinstance(error.__cause__, NotDask):
        error = error.__cause__
    if error.first.startswith(b"HTTP/"):
        return DASHBOARD
    if error.first.startswith(b"SSH-"):
        return f"it is an SSH server: {error}"
    if error.first[:1] in (b"\x15", b"\x16") and error.first[1:2] == b"\x03":
        return "it speaks TLS: give its tls:// address and certificates (--tls-ca-file ...)"
    return str(error)


def _closed(address: str) -> str:
    """Why an address closed the connection before a handshake: a TLS listener (Dask's among
    them) closes a plain one."""
    if address.startswith("tls://"):
        return "it closed the connection without a Dask handshake"
    return (
        "it closed the connection without a Dask handshake; a TLS scheduler is reached at its "
        "tls:// address, with its certificates"
    )


def _silent(address: str, timeout: float) -> str:
    """Why an address that took the connection sent no handshake: an HTTP server (of what a
    user may type, what does not speak first), or nothing to tell."""
    scheme, _, where = address.rpartition("://")
    host, _, port = where.rpartition(":")
    if scheme in ("", "tcp") and port.isdigit() and _speaks_http(host.strip("[]"), int(port)):
        return not_a_scheduler(address, DASHBOARD)
    return (
        f"{address} took the connection but sent no Dask handshake within {timeout:g} s (a "
        "scheduler stopped or too busy to answer, or no scheduler at all)"
    )


def _speaks_http(host: str, port: int) -> bool:
    """Whether ``host:port`` answers an HTTP request within ASK_HTTP seconds."""
    try:
        with socket.create_connection((host, port), ASK_HTTP) as sock:
            sock.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            got, deadline = b"", time.monotonic() + ASK_HTTP
            while len(got) < 5 and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(5 - len(got))
                if not chunk:
                    break
                got += chunk
    except OSError:
        return False
    return got == b"HTTP/"


def client(*args, **kwargs):
    """``distributed.Client(*args, **kwargs)``, closed here if it fails to start: one left to
    its ``__del__`` is closed at the interpreter's exit, once Dask's loop is gone, and waits
    out twice its timeout there."""
    from distributed import Client

    made = Client.__new__(Client)  # to hold it while its __init__ raises
    try:
        made.__init__(*args, **kwargs)
    except BaseException:
        with contextlib.suppress(Exception):
            made.close(timeout=2)
        raise
    return made
