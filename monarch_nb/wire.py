"""Messages between processes with low latency: ``Writer`` for a distributed comm on its event
loop, ``FrameConn`` for the controller-to-engine data path on plain sockets, used from threads,
and ``Listeners``, where a worker takes those sockets in (over TCP, or a Unix-domain socket from
a caller on the same host)."""

from __future__ import annotations

import _signal
import asyncio
import contextlib
import io
import logging
import os
import pickle
import secrets
import select
import signal
import socket
import ssl
import struct
import threading
import time
from collections import deque
from typing import Any

from distributed.comm import CommClosedError

logger = logging.getLogger("monarch_nb")


class SigintHold:
    """Once armed (only where a write happens), Ctrl-C (SIGINT) on the main thread waits for
    ``release()``, then is delivered: a message sent to several peers reaches all of them, not
    the first few (one actor in a collective that the others never join waits for ever)."""

    def __init__(self) -> None:
        self._pressed: list[int] = []
        self._previous: Any = None
        self._armed = False

    def arm(self) -> None:
        if self._armed or threading.current_thread() is not threading.main_thread():
            return
        # _signal: the signal module's enum wrapping costs more than the send it guards
        self._previous = _signal.signal(_signal.SIGINT, lambda s, f: self._pressed.append(s))
        self._armed = True

    def release(self) -> None:
        if not self._armed:
            return
        self._armed = False
        _signal.signal(_signal.SIGINT, self._previous)
        if self._pressed:
            signal.raise_signal(signal.SIGINT)  # the handler put back takes it now


class Writer:
    """Writes messages to a comm in order, batching what arrives during a write: lighter than
    distributed's BatchedSend (no timer per message). ``send`` runs on the comm's event loop."""

    def __init__(self, comm):
        self.comm = comm
        self._buffer: list[dict] = []
        self._task: asyncio.Task | None = None

    def send(self, *msgs: dict) -> None:
        self._buffer.extend(msgs)
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until everything sent has been written."""
        if self._task is not None:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def _drain(self) -> None:
        try:
            while self._buffer and not self.comm.closed():
                batch, self._buffer = self._buffer, []
                await self.comm.write(batch, on_error="raise")
        except (CommClosedError, OSError):
            self.comm.abort()  # the reader sees it and reports the worker gone
        except Exception:
            logger.exception("cannot write messages to %s", self.comm.peer_address)
            self.comm.abort()
        finally:
            self._task = None


HEADER = struct.Struct("!Q")  # the length of the pickled message that follows
# The most a peer's first message may claim, here and on Dask's TCP comms, before it has shown
# it is one of ours: handshakes are under 200 bytes; an SSH banner's first 8 bytes claim 2.8 EiB
MAX_HANDSHAKE = 64 * 1024
# Requests sent once per rank and id, which a controller may send again after its relay ended
# (dispatch/resending.py); an engine drops the second copy.
RESENT_OPS = ("execute", "call")
MAX_READ = 1 << 20
_reading = threading.local()


def scratch_buffer() -> memoryview:
    """This thread's buffer to receive into. A fresh MAX_READ bytes per recv() was an mmap,
    an mremap and an munmap for every message, and an munmap in a process with many threads
    makes the kernel flush the others' TLBs: a tenth of a trivial cell's round trip."""
    if getattr(_reading, "buf", None) is None:
        _reading.buf = memoryview(bytearray(MAX_READ))
    return _reading.buf


def frame(msg: Any) -> tuple[bytes, ...]:
    """``msg`` pickled behind its length, as ``FrameConn.post_frame`` sends it."""
    data = pickle.dumps(msg, protocol=5)
    if len(data) < 65536:
        # one send, so one segment: the header alone would wake the reader for nothing
        return (HEADER.pack(len(data)) + data,)
    return HEADER.pack(len(data)), data


class FrameConn:
    """Pickled messages, each behind an 8-byte length, over a plain or TLS socket.

    The data path between a controller and an engine: ``send`` may be called from any thread
    (a lock keeps frames whole); ``feed`` is called by the one thread that reads, when
    ``select`` says the socket is readable, and returns the messages that are complete.

    A TLS connection is one OpenSSL object, which two threads must never use at once: a read
    that takes in a TLS 1.3 session ticket runs the handshake machine, and a write in another
    thread at that moment runs it too, so a frame vanishes or the connection breaks (a setup
    that was never answered). So a TLS socket is non-blocking after its handshake and every
    call into OpenSSL holds ``_tls``; a writer waits for room outside it.
    """

    def __init__(self, sock: socket.socket):
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.lock = threading.Lock()  # keeps frames whole
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._tls = threading.Lock()  # one call into OpenSSL at a time
        self._eof = False
        if self.tls:
            sock.setblocking(False)
        self._backlog: list[Any] = []
        self._buf = bytearray()
        self._unsent: deque[memoryview] = deque()  # what post() left to its writing thread

    @property
    def backlog(self) -> list[Any]:
        """What arrived behind the handshake (``recv_one``), unpickled only once the taker has
        checked it: read by the thread that feeds the connection next, before it does."""
        if self._buf:
            out, start = unframe(self._buf, len(self._buf))
            del self._buf[:start]
            self._backlog.extend(out)
        return self._backlog

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        with self.lock:
            self.send_locked(msg)

    def send_locked(self, msg: Any) -> None:
        """``send`` for a caller that already holds ``lock``."""
        data = pickle.dumps(msg, protocol=5)
        sendall = self._tls_sendall if self.tls else self.sock.sendall
        if len(data) < 65536:
            sendall(HEADER.pack(len(data)) + data)
        else:
            sendall(HEADER.pack(len(data)))
            sendall(data)

    def _tls_sendall(self, data) -> None:
        view = memoryview(data)
        while len(view):
            view = view[self._tls_send(view) :]

    def _tls_send(self, chunk) -> int:
        """Write some of ``chunk``, waiting (outside ``_tls``) until the socket takes it; a
        retry after a refusal passes the same bytes, as OpenSSL requires."""
        while True:
            with self._tls:
                try:
                    return self.sock.send(chunk)
                except ssl.SSLWantWriteError:
                    wait = select.POLLOUT
                except ssl.SSLWantReadError:  # the reading thread takes what it waits for
                    wait = select.POLLIN
            _wait(self.sock, wait, 0.05)

    def post(self, msg: Any) -> None:
        """``send`` that never blocks the caller. What the socket does not take at once (the
        other side's thread is busy and its buffer full, or its process is stopped) is written
        by a thread of its own, in order: a caller left blocked could only be stopped by
        Ctrl-C, and a frame cut in the middle makes every later message unreadable."""
        self.post_frame(frame(msg))

    def post_frame(self, parts: tuple[bytes, ...]) -> None:
        """``post`` of a message already framed (``frame``): a request to many ranks is
        pickled once, not once per rank."""
        with self.lock:
            if self._unsent:  # the writing thread is behind: after what it has
                self._unsent.extend(memoryview(part) for part in parts)
                return
            left = [memoryview(part) for part in parts]
            while left:
                try:
                    n = self._send_now(left[0])
                except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                    break
                except ssl.SSLWantReadError:  # it needs the reading side: the thread waits
                    break
                left[0] = left[0][n:]
                if not len(left[0]):
                    left.pop(0)
            if not left:
                return
            threading.Thread(target=self._write_unsent, daemon=True, name="monarch-post").start()
            self._unsent.extend(left)

    def _send_now(self, chunk) -> int:
        """Write what the socket takes of ``chunk`` without waiting. A TLS socket is
        non-blocking already; one that refuses is retried by the thread with the same bytes,
        as OpenSSL requires."""
        if self.tls:
            with self._tls:
                return self.sock.send(chunk)
        return self.sock.send(chunk, socket.MSG_DONTWAIT)

    def _write_unsent(self) -> None:
        """The thread that writes what post() could not; it ends once everything is written
        (while anything is left, post() only appends, so this is the one writer)."""
        while True:
            with self.lock:
                if not self._unsent:
                    return
                chunk = self._unsent[0]
            try:
                n = self._tls_send(chunk) if self.tls else self.sock.send(chunk)
            except OSError:  # the connection is gone: the reading thread reports it
                with self.lock:
                    self._unsent.clear()
                return
            with self.lock:
                if n < len(chunk):
                    self._unsent[0] = chunk[n:]
                else:
                    self._unsent.popleft()

    def feed(self, first_limit: int | None = None) -> list[Any] | None:
        """The complete messages now readable, or None once the other side has closed; never
        blocks. ``first_limit``: the most the first message may claim (``recv_one``)."""
        if self.tls:
            if self._eof or not self._tls_read():
                return None
        else:
            scratch = scratch_buffer()
            try:  # two threads may both have seen it readable (dispatch/reader.py)
                got = self.sock.recv_into(scratch, MAX_READ, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return []
            if not got:
                return None
            if not self._buf:  # the usual case: whole messages, read where they landed
                out, start = unframe(scratch, got, first_limit)
                self._buf += scratch[start:got]
                return out
            self._buf += scratch[:got]
        out, start = unframe(self._buf, len(self._buf), first_limit)
        if start:
            del self._buf[:start]
        return out

    def _tls_read(self) -> bool:
        """Take in what the socket holds; False once the other side has closed. Readable may
        mean only a record that carries no data (a session ticket), or part of one."""
        taken = 0
        with self._tls:
            # Up to MAX_READ at a time, so that one busy sender does not starve the reader's
            # other connections; never leaving decrypted bytes behind, which select cannot see.
            scratch = scratch_buffer()
            while taken < MAX_READ or self.sock.pending():
                try:
                    got = self.sock.recv_into(scratch, MAX_READ)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return True
                if not got:
                    self._eof = True  # said on the next call, after what came before the end
                    return taken > 0
                self._buf += scratch[:got]
                taken += got
        return True

    def recv_one(self, timeout: float) -> Any:
        """Block (at most ``timeout`` seconds) for one message: the handshake, which may claim
        MAX_HANDSHAKE bytes at most (ValueError: a stranger's banner is no length to wait for)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not _wait(self.sock, select.POLLIN, left):
                raise TimeoutError(f"no handshake within {timeout:g} s")
            msgs = self.feed(MAX_HANDSHAKE)
            if msgs is None:
                raise ConnectionError("the connection closed during the handshake")
            if msgs:
                return msgs[0]  # what came behind it stays in the buffer: see backlog

    def shutdown(self) -> None:
        """End the connection; the reading thread sees the end and closes the socket."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        with contextlib.suppress(OSError):
            self.sock.close()


class MalformedMessage(ConnectionError):
    """A peer sent no message of ours: its connection is given up on, as if closed, with why."""


class _PlainUnpickler(pickle.Unpickler):
    """A handshake's reader: dicts, lists, strings, numbers, nothing else. It comes before the
    peer has shown its token, so nothing it names is imported or called."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a handshake names {module}.{name}: only plain data is")


def _loads(data, handshake: bool) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(data)).load() if handshake else pickle.loads(data)
    except Exception as e:  # anything a stranger's bytes make pickle raise
        raise MalformedMessage(f"it sent a malformed message ({type(e).__name__}: {e})") from None


def unframe(buf, end: int, first_limit: int | None = None) -> tuple[list[Any], int]:
    """The whole messages in ``buf[:end]``, and where the first incomplete one starts; a first
    one that claims more than ``first_limit`` bytes is refused (ValueError), whole or not, and
    is read as plain data only. A message that does not unpickle: MalformedMessage."""
    out = []
    start = 0
    size = HEADER.size
    while end - start >= size:
        (n,) = HEADER.unpack_from(buf, start)
        handshake = first_limit is not None and not start
        if handshake and n > first_limit:
            raise ValueError(claim(buf[:size], n, first_limit))
        if end - start - size < n:
            break
        out.append(_loads(buf[start + size : start + size + n], handshake))
        start += size + n
        if handshake:
            break  # the rest waits until the handshake has been checked (FrameConn.backlog)
    return out, start


def claim(first, claimed: int, limit: int) -> str:
    """A peer's first 8 bytes, and the size they claim against ``limit``, in words."""
    first = bytes(first)
    shown = first.decode() if all(32 <= b < 127 for b in first) else first.hex(" ")
    size, most = _size(claimed), _size(limit)
    return f"its first bytes ({shown}) claim a message of {size}; a handshake is {most} at most"


def _size(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    power = next((i for i in range(6) if n < 1024 ** (i + 1)), 6)
    return f"{n / 1024**power:.3g} {units[power]}"


def _wait(sock: socket.socket, events: int, timeout: float) -> bool:
    """Whether ``sock`` became ready for ``events`` within ``timeout`` seconds (poll, not
    select: a process with many files has descriptors past select's 1024)."""
    fd = sock.fileno()
    if fd < 0:  # closed meanwhile: the next call on it raises
        return True
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(timeout * 1000))


def host_of(address: str) -> str:
    """The host of a Dask address (``tcp://10.0.0.7:8786`` -> ``10.0.0.7``, IPv6 unbracketed)."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def sent_after(request_id: str | None, mark: str) -> bool:
    """Whether request ``request_id`` was made after ``mark`` by the same controller process
    (ids are ``kind-N-P``: dispatch/links.py's ``new_id``)."""
    try:
        _, n, process = (request_id or "").rsplit("-", 2)
        _, n_mark, process_mark = mark.rsplit("-", 2)
        return process == process_mark and int(n) > int(n_mark)
    except ValueError:
        return False


class Listeners:
    """Where a worker takes data connections in (the engine's and the actors'): a TCP socket on
    the worker's host, TLS where the cluster uses TLS, and beside it, where it does not and the
    system has them (Linux), a Unix-domain socket in the abstract namespace for a caller on the
    same host. A send over it skips the kernel's TCP/IP stack: 30 µs instead of loopback TCP's
    53 on the development machine (the controller's sends of 1,000 trivial cells to 2 ranks,
    cProfile), and a trivial cell's round trip is mostly such sends and their wake-ups. Only
    processes of this user are let in on it (the peer's credentials, checked at accept), and,
    as over TCP, only a caller that names itself with the token of the handshake.

    ``hello()`` is what the handshake tells a caller; ``connect_local`` tries the local socket
    (its caller falls back to TCP: another host, another network namespace, another user)."""

    def __init__(self, host: str, ssl_context):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tcp = socket.create_server((host, 0), family=family)
        self.port = self.tcp.getsockname()[1]
        self.ssl_context = ssl_context
        self.local: socket.socket | None = None
        self.local_name: str | None = None
        if ssl_context is None and hasattr(socket, "SO_PEERCRED"):
            name = f"monarch-nb-{os.getpid()}-{secrets.token_hex(8)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind("\0" + name)  # abstract: no file to leave behind, gone with the process
                sock.listen()
            except OSError:
                sock.close()
            else:
                self.local, self.local_name = sock, name

    def hello(self) -> dict[str, Any]:
        where: dict[str, Any] = {"port": self.port}
        if self.local_name is not None:  # and whom it lets in
            where["local"], where["uid"] = self.local_name, os.geteuid()
        return where

    def serve(self, timeout: float, on_hello, what: str, thread_name: str) -> None:
        """Accept on each listener from a thread of its own (``accept_forever``)."""
        for sock in (self.tcp, self.local):
            if sock is not None:
                threading.Thread(
                    target=accept_forever,
                    args=(sock, self.ssl_context, timeout, on_hello, what),
                    name=thread_name,
                    daemon=True,
                ).start()


def connect_local(hello: dict[str, Any], timeout: float) -> socket.socket | None:
    """A connected socket to the local listener ``hello`` names, or None where it names none or
    it cannot be reached from here (another host or network namespace): then use TCP.
    ``timeout`` 0 never waits (a listener whose backlog is full is not waited for)."""
    name = hello.get("local")
    if not isinstance(name, str) or hello.get("uid") != os.geteuid():
        return None  # none, or one that would refuse this user's process after connecting
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        return None
    sock.settimeout(None)
    return sock


def _same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of a Unix-domain socket runs as this user."""
    creds = struct.Struct("3i")  # struct ucred: pid, uid, gid
    _, uid, _ = creds.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))
    return uid == os.geteuid()


def accept_forever(listener: socket.socket, ssl_context, timeout: float, on_hello, what: str):
    """Accept connections on ``listener`` one at a time (TLS with ``ssl_context`` unless it is
    the Unix-domain one), read each one's first message within ``timeout`` seconds and hand
    ``(conn, hello)`` to ``on_hello``, which checks it; one that fails its handshake is closed
    and logged (``what`` it was). Returns once the listener is closed."""
    local = listener.family == socket.AF_UNIX
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        try:
            if local and not _same_user(sock):
                raise ValueError("another user's process")
            if ssl_context is not None and not local:
                sock.settimeout(timeout)
                sock = ssl_context.wrap_socket(sock, server_side=True)
            conn = FrameConn(sock)
            hello = conn.recv_one(timeout)
        except (OSError, ValueError, EOFError) as e:
            logger.info("monarch_nb: refused %s: %s", what, e)
            with contextlib.suppress(OSError):
                sock.close()
            continue
        on_hello(conn, hello)
