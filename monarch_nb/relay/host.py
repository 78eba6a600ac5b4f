"""The host relay: one on each host with ranks, between the controller (over TCP) and the
engines there (over their abstract Unix sockets), both ways. It moves bytes, unpickles nothing.

Start: ``python -I -S host.py HOST``. It reads the token (hex) from stdin's first line, listens
on (HOST, 0), prints ``{"port": P, "pid": PID}`` as one line, and accepts connections until one
sends ``T`` + token as its first message, whole within TOKEN_WITHIN seconds; one that sends
anything else (or claims more than 256 bytes) is closed. None within ACCEPT_WITHIN seconds
(MONARCH_RELAY_ACCEPT_WITHIN, seconds, overrides it): it exits. Then the listener closes: it
serves that one controller, and when its connection ends it closes every engine's socket and
exits (status 0). It ignores SIGINT, which JupyterLab's stop button sends to process groups.

A message, either way, is a ``!Q`` length and that many bytes of body, whose first byte is its
kind; an ident and a count are ``!I``, a name's length ``!H``. Down, from the controller:

- ``T`` + token: the first message, and only then;
- ``O`` + ident + name length + name (utf-8, the engine's abstract socket name without its
  NUL) + handshake: connect to the engine, write the handshake first, then read it. An ``O`` for
  an open ident replaces it; a connect that fails is answered with a ``C``;
- ``F`` + count + that many idents + payload: write the payload to each of those engines;
- ``H`` + ident + payload: write the payload on a new connection to that engine's name and close
  it (interrupts and acks, which its accepting thread reads while the rank is busy); best
  effort: dropped unless the connect and the whole write go through at once;
- ``D`` + ident: close that engine's socket and forget it (nothing goes up).

An ident not known (never opened, closed) is skipped. A malformed message, or one that claims
more than 1 GiB, is a protocol error: the relay exits (status 1). Up, to the controller:

- ``E`` + ident + bytes: bytes read from that engine, as read (the controller reassembles its
  frames), in order for each ident;
- ``C`` + ident + reason (utf-8): that engine's connection ended, after its last ``E``; the
  ident is forgotten.

Writes never block: what an engine's socket does not take waits for it, in order, while the
others go on. Everything read from the engines in one turn of the loop (at most READ_CHUNK from
each, so that a busy one starves none) goes up in one write: the controller wakes once a batch,
not once a rank; and while engines it wrote a request to have not answered yet, what was read
waits for them, LINGER at most, so that a request's answers go up together (while many are
awaited, the relay naps between looks rather than wake at each: NAP). Memory bound:
while more than MAX_PENDING_UP bytes wait to go up, no engine is read (they block in their own
writes) until under half of it, so what waits up is at most MAX_PENDING_UP plus one turn's
reads. What waits down is not bounded (as in relay/main.py).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import time

LENGTH = struct.Struct("!Q")
IDENT = struct.Struct("!I")
NAME_LEN = struct.Struct("!H")
TOKEN_WITHIN = 5.0
ACCEPT_WITHIN = 60.0
CONNECT_WITHIN = 5.0
MAX_TOKEN = 256
MAX_DOWN = 1 << 30
MAX_PENDING_UP = 8 << 20
# dispatch/links.py's KEEPALIVE, the controller's side of the same connection (this file
# imports nothing but the standard library; tests/relay/test_host_relay.py keeps them equal)
KEEPALIVE = {"TCP_KEEPIDLE": 1, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 5000}
LINGER = 0.001  # seconds what was read waits for the answers of engines just asked
# While NAP_FROM engines or more are still to answer, the relay sleeps NAP between looks
# instead of waking at each answer: they gather in their sockets, and an engine's write finds
# nobody to wake. With 64 stand-in ranks on each of 16 simulated hosts (bench_fanout.py
# --kinds hosts), a trivial cell at 1,024 ranks took 24.6 ms against 29.4, the relays' CPU
# 12.9 ms against 16.9 and the stand-ins' 26.8 against 32.1; from 8 and 16 ranks a host,
# unchanged (a nap from the first answer cost more there: 5.9 against 4.5 ms at 128 ranks).
NAP = 0.0006
NAP_FROM = 16
READ_CHUNK = 256 << 10
MAX_IOV = 64  # buffers to one sendmsg: well under any IOV_MAX
READ = selectors.EVENT_READ  # (accepting)
IN, OUT = select.EPOLLIN, select.EPOLLOUT
IN_ANY = IN | select.EPOLLHUP | select.EPOLLERR  # what a read then finds: data, its end


class ProtocolError(Exception):
    """The controller sent what this protocol does not have: the relay ends."""


class Caller:
    """A connection that has not presented the token yet."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, bytearray()
        self.deadline = time.monotonic() + TOKEN_WITHIN

    def feed(self, token: bytes) -> bytes | None:
        """What came behind the token once that is whole; ConnectionError if refused."""
        got = self.sock.recv(1 << 16)
        if not got:
            raise ConnectionError("closed before its token")
        self.buf += got
        head = LENGTH.size
        (n,) = LENGTH.unpack_from(self.buf) if len(self.buf) >= head else (0,)
        if n > MAX_TOKEN:
            raise ConnectionError("its first message is too long")
        if len(self.buf) < head + max(n, 1):
            return None
        if not hmac.compare_digest(bytes(self.buf[head : head + n]), b"T" + token):
            raise ConnectionError("wrong token")
        return bytes(self.buf[head + n :])  # the controller need not wait before its requests


def accept(listener: socket.socket, token: bytes, within: float):
    """The first connection to present the token and what it sent behind it, or None."""
    end = time.monotonic() + within
    callers: dict[socket.socket, Caller] = {}
    with selectors.DefaultSelector() as sel:
        sel.register(listener, READ)
        try:
            while (now := time.monotonic()) < end:
                for key, _ in sel.select(min([end, *(c.deadline for c in callers.values())]) - now):
                    if key.fileobj is listener:
                        with contextlib.suppress(OSError):  # (one that left already)
                            sock = listener.accept()[0]
                            sock.setblocking(False)
                            callers[sock] = Caller(sock)
                            sel.register(sock, READ)
                        continue
                    caller = callers[key.fileobj]
                    try:
                        rest = caller.feed(token)
                    except BlockingIOError:
                        continue
                    except OSError:  # refused: closed below, and the relay goes on
                        caller.deadline = 0
                        continue
                    if rest is not None:
                        sel.unregister(caller.sock)
                        return callers.pop(caller.sock).sock, rest
                for sock in [s for s, c in callers.items() if c.deadline <= time.monotonic()]:
                    sel.unregister(sock)
                    callers.pop(sock).sock.close()
            return None
        finally:
            for sock in callers:
                sock.close()


class Engine:
    """One engine's socket and what it has not taken yet."""

    def __init__(self, ident: int, name: str, sock: socket.socket):
        self.ident, self.name, self.sock = ident, name, sock
        self.unsent: collections.deque[memoryview] = collections.deque()
        self.events = 0  # what the selector watches it for
        self.broken = False  # a write failed: it takes nothing more, but is read to its end


class HostRelay:
    def __init__(self, ctl: socket.socket, down: bytes):
        self.ctl = ctl
        self.engines: dict[int, Engine] = {}
        self.down = bytearray(down)
        self.batch: list[bytes] = []  # this turn's records up
        self.up: collections.deque[memoryview] = collections.deque()  # earlier turns' rest
        self.pending_up = 0
        # engines sent a request and not heard from since: their answers are waited for (at
        # most LINGER) so that a request's answers go up together, one wake-up of the kernel
        self.awaited: set[int] = set()
        self.held_since: float | None = None
        self.scratch = memoryview(bytearray(READ_CHUNK))
        self.reading = True
        # epoll itself, not selectors: its bookkeeping per event was a tenth of the relay's work
        self.ep = select.epoll()
        self.ep.register(ctl.fileno(), IN)
        self.ctl_events = IN
        self.by_fd: dict[int, Engine] = {}

    def run(self) -> None:
        try:
            self.parse_down()  # what came behind the token
            while True:
                wait = self.flush()  # the last turns' reads, in one write, or how long to hold
                ctl, by_fd, engines = self.ctl.fileno(), self.by_fd, self.engines
                if wait > 0 and len(self.awaited) >= NAP_FROM:
                    time.sleep(min(wait, NAP))
                    wait = 0
                for fd, events in self.ep.poll(wait):
                    if fd == ctl:
                        if events & IN_ANY:
                            self.read_down()
                        continue
                    engine = by_fd.get(fd)
                    if engine is None or engines.get(engine.ident) is not engine:
                        continue  # dropped this turn
                    if events & OUT:
                        self.write(engine)
                    if events & IN_ANY:
                        self.read(engine)
        except EOFError:  # the controller's connection ended
            pass
        finally:
            for engine in self.engines.values():
                engine.sock.close()
            self.ep.close()
            self.ctl.close()

    # -- from the controller -------------------------------------------------------------------
    def read_down(self) -> None:
        try:
            got = self.ctl.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:  # keep-alive's timeout included: the controller's host is gone
            raise EOFError from None
        if not got:
            raise EOFError
        self.down += got
        self.parse_down()

    def parse_down(self) -> None:
        buf = self.down
        start, end = 0, len(buf)
        with memoryview(buf) as view:
            while end - start >= LENGTH.size:
                (n,) = LENGTH.unpack_from(buf, start)
                if n == 0 or n > MAX_DOWN:
                    raise ProtocolError(f"a message of {n} bytes")
                if end - start - LENGTH.size < n:
                    break
                body = start + LENGTH.size
                try:
                    self.handle(view[body : body + n])
                except (struct.error, UnicodeDecodeError) as e:
                    raise ProtocolError(f"a malformed {bytes(view[body : body + 1])!r}") from e
                start = body + n
        del buf[:start]

    def handle(self, body: memoryview) -> None:
        kind = bytes(body[:1])
        if kind == b"F":
            (count,) = IDENT.unpack_from(body, 1)
            idents = struct.unpack_from(f"!{count}I", body, 1 + IDENT.size)
            payload = bytes(body[1 + IDENT.size * (count + 1) :])  # one copy, for all of them
            for ident in idents:
                engine = self.engines.get(ident)
                if engine is not None and not engine.broken:
                    self.send(engine, payload)
                    self.awaited.add(ident)
            return
        (ident,) = IDENT.unpack_from(body, 1)
        rest = body[1 + IDENT.size :]
        if kind == b"O":
            (size,) = NAME_LEN.unpack_from(rest)
            name = str(rest[NAME_LEN.size : NAME_LEN.size + size], "utf-8")
            self.open(ident, name, bytes(rest[NAME_LEN.size + size :]))
        elif kind == b"H":
            engine = self.engines.get(ident)
            if engine is not None:
                poke(engine.name, rest)
        elif kind == b"D":
            self.drop(ident)
        else:
            raise ProtocolError(f"an unknown kind {kind!r}")

    def open(self, ident: int, name: str, handshake: bytes) -> None:
        self.drop(ident)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # a Unix connect waits only while the engine's backlog is full, so a timeout of its own
        # bounds that stall; a non-blocking one would fail there instead, and cannot be resumed
        sock.settimeout(CONNECT_WITHIN)
        try:
            sock.connect("\0" + name)
        except OSError as e:
            sock.close()
            self.record(b"C", ident, f"could not connect: {type(e).__name__} {e}".encode())
            return
        sock.setblocking(False)
        engine = self.engines[ident] = Engine(ident, name, sock)
        self.send(engine, handshake)  # first, before any request
        self.watch(engine)  # read from now on

    # -- to the engines ----------------------------------------------------------------------
    def send(self, engine: Engine, data: bytes) -> None:
        if not engine.unsent:  # the usual case: an engine's socket with room takes it whole
            try:
                n = engine.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:  # its end closed: still read to its EOF, so its C goes up last
                engine.broken = True
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
        engine.unsent.append(memoryview(data))
        self.watch(engine)  # the rest when it has room

    def write(self, engine: Engine) -> None:
        try:
            while engine.unsent:
                n = engine.sock.send(engine.unsent[0])
                if n < len(engine.unsent[0]):
                    engine.unsent[0] = engine.unsent[0][n:]
                    break
                engine.unsent.popleft()
        except BlockingIOError:
            pass
        except OSError:
            # its end closed: what it wrote before is still read, then its EOF, so that its C
            # goes up behind its last bytes
            engine.broken = True
            engine.unsent.clear()
        self.watch(engine)

    def watch(self, engine: Engine) -> None:
        events = (IN if self.reading else 0) | (OUT if engine.unsent else 0)
        if events == engine.events:
            return
        fd = engine.sock.fileno()
        if not engine.events:
            self.ep.register(fd, events)
            self.by_fd[fd] = engine
        elif not events:
            self.ep.unregister(fd)
            del self.by_fd[fd]
        else:
            self.ep.modify(fd, events)
        engine.events = events

    def drop(self, ident: int, reason: str | None = None) -> None:
        engine = self.engines.pop(ident, None)
        if engine is None:
            return
        self.awaited.discard(ident)
        if engine.events:
            fd = engine.sock.fileno()
            self.ep.unregister(fd)
            del self.by_fd[fd]
        engine.sock.close()
        if reason is not None:
            self.record(b"C", ident, reason.encode())

    # -- from the engines, to the controller ---------------------------------------------------
    def read(self, engine: Engine) -> None:
        # into one buffer, then copied out at its size: a fresh READ_CHUNK bytes per recv() is
        # an mmap and an munmap per message (a large allocation), which cost more than the rest
        try:
            n = engine.sock.recv_into(self.scratch, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError as e:
            self.drop(engine.ident, f"its connection closed ({type(e).__name__}: {e})")
            return
        if n:
            self.awaited.discard(engine.ident)
            self.record(b"E", engine.ident, self.scratch[:n])
        else:
            self.drop(engine.ident, "its connection closed")

    def record(self, kind: bytes, ident: int, data) -> None:
        self.batch.append(LENGTH.pack(1 + IDENT.size + len(data)) + kind + IDENT.pack(ident))
        self.batch.append(bytes(data))

    def flush(self) -> float:
        """Send what this turn read, unless engines just asked are still to answer and it has
        waited for them less than LINGER: then the seconds left to wait (-1: none)."""
        if self.batch and self.awaited:
            now = time.monotonic()
            if self.held_since is None:
                self.held_since = now
            left = self.held_since + LINGER - now
            if left > 0:
                return left
        self.held_since = None
        if self.batch:
            turn = memoryview(b"".join(self.batch))  # the turn's batch: one write, one wake-up
            self.batch.clear()
            self.up.append(turn)
            self.pending_up += len(turn)
        if self.up:
            try:
                n = self.ctl.sendmsg(list(itertools.islice(self.up, MAX_IOV)))
            except BlockingIOError:
                n = 0
            except OSError:
                raise EOFError from None
            self.pending_up -= n
            while n:
                head = self.up[0]
                if n < len(head):
                    self.up[0] = head[n:]
                    break
                n -= len(head)
                self.up.popleft()
        events = IN | (OUT if self.up else 0)
        if events != self.ctl_events:
            self.ep.modify(self.ctl.fileno(), events)
            self.ctl_events = events
        reading = self.pending_up <= (MAX_PENDING_UP // 2 if not self.reading else MAX_PENDING_UP)
        if reading != self.reading:  # the engines wait in their writes until the controller reads
            self.reading = reading
            for engine in self.engines.values():
                self.watch(engine)
        return -1


def poke(name: str, payload: memoryview) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect("\0" + name)
            sock.send(payload)  # a few hundred bytes: an empty socket takes them whole
        except OSError:
            pass  # best effort: the controller asks again if it must


def keep_alive(sock: socket.socket) -> None:
    """So that a controller whose host vanished ends the relay within seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def main(argv: list[str]) -> None:
    # JupyterLab's stop button signals whole process groups; the controller ends the relay
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    within = float(os.environ.get("MONARCH_RELAY_ACCEPT_WITHIN", ACCEPT_WITHIN))
    token = sys.stdin.readline().strip().encode("ascii")
    host = argv[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as listener:
        listener.setblocking(False)
        print(json.dumps({"port": listener.getsockname()[1], "pid": os.getpid()}), flush=True)
        with open(os.devnull, "wb") as null:  # the worker that reads stdout sees its end
            os.dup2(null.fileno(), sys.stdout.fileno())
        accepted = accept(listener, token, within)
    if accepted is None:
        return
    ctl, rest = accepted
    ctl.setblocking(False)
    keep_alive(ctl)
    try:
        HostRelay(ctl, rest).run()
    except ProtocolError as e:
        sys.exit(f"host relay: protocol error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
