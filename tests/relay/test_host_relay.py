"""The host relay (relay/host.py), as a real process: a controller over TCP that presents its
token, engines that are abstract Unix listeners of the test's own. Requests go down to the
engines named, in order; what the engines write comes back batched, whole and in order, and the
relay ends with its controller."""

from __future__ import annotations

import collections
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from monarch_nb.dispatch.links import KEEPALIVE
from monarch_nb.relay import host as relay_host

HOST_PY = relay_host.__file__
TOKEN = secrets.token_hex(16)


def _msg(kind: bytes, *parts: bytes) -> bytes:
    body = kind + b"".join(parts)
    return struct.pack("!Q", len(body)) + body


def _open(ident: int, name: str, handshake: bytes = b"") -> bytes:
    raw = name.encode()
    return _msg(b"O", struct.pack("!IH", ident, len(raw)), raw, handshake)


def _forward(idents: list[int], payload: bytes) -> bytes:
    return _msg(b"F", struct.pack(f"!I{len(idents)}I", len(idents), *idents), payload)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, f"EOF after {len(got)} of {n} bytes"
        got += chunk
    return bytes(got)


class Relay:
    """A relay process, its controller's connection, and every socket the test opened."""

    def __init__(self, env: dict[str, str] | None = None):
        self.sockets: list[socket.socket] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(HOST_PY), "127.0.0.1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self.proc.stdin.write(TOKEN.encode() + b"\n")
        self.proc.stdin.close()
        started = json.loads(self.proc.stdout.readline())
        self.proc.stdout.close()
        assert started["pid"] == self.proc.pid
        self.port = started["port"]
        self.ctl: socket.socket | None = None
        self.buf = bytearray()
        self.messages: collections.deque[tuple[bytes, int, bytes]] = collections.deque()

    def keep(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(5)
        self.sockets.append(sock)
        return sock

    def dial(self, first: bytes, rcvbuf: int | None = None) -> socket.socket:
        sock = self.keep(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        if rcvbuf:  # set before connecting: TCP does not grow it on its own then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", self.port))
        sock.sendall(first)
        return sock

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        self.ctl = self.dial(_msg(b"T", TOKEN.encode()), rcvbuf)
        return self.ctl

    def engine(self) -> tuple[socket.socket, str]:
        """An engine's listener, under a name of its own."""
        name = f"monarch-test-{secrets.token_hex(8)}"
        listener = self.keep(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind("\0" + name)
        listener.listen()
        return listener, name

    def attach(self, ident: int, handshake: bytes = b"") -> tuple[socket.socket, socket.socket]:
        """An engine the relay opened (its handshake read): its listener and its connection."""
        listener, name = self.engine()
        self.ctl.sendall(_open(ident, name, handshake))
        conn = self.keep(listener.accept()[0])
        assert _recv_exactly(conn, len(handshake)) == handshake
        return listener, conn

    def recv_batch(self) -> list[tuple[bytes, int, bytes]]:
        """The messages that one recv completes."""
        got = self.ctl.recv(1 << 20)
        assert got, "the relay closed the controller's connection"
        self.buf += got
        batch = []
        while len(self.buf) >= 8:
            (n,) = struct.unpack_from("!Q", self.buf)
            if len(self.buf) < 8 + n:
                break
            body = bytes(self.buf[8 : 8 + n])
            del self.buf[: 8 + n]
            batch.append((body[:1], struct.unpack_from("!I", body, 1)[0], body[5:]))
        self.messages.extend(batch)
        return batch

    def next(self) -> tuple[bytes, int, bytes]:
        while not self.messages:
            self.recv_batch()
        return self.messages.popleft()

    def received(self, ident: int, n: int) -> bytes:
        """n bytes from the engine ident, from its E messages (none other comes between)."""
        got = bytearray()
        while len(got) < n:
            kind, who, data = self.next()
            assert (kind, who) == (b"E", ident)
            got += data
        return bytes(got)

    def stopped(self) -> None:
        """Waits for SIGSTOP to land: a select that returned before it would take one engine."""
        deadline = time.monotonic() + 5
        while Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the relay did not stop"
            time.sleep(0.001)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def relay():
    relay = Relay()
    try:
        yield relay
    finally:
        relay.close()


def test_a_wrong_token_is_refused_and_the_right_one_then_served(relay):
    wrong = relay.dial(_msg(b"T", b"0" * len(TOKEN)))
    assert wrong.recv(1) == b""  # closed
    greedy = relay.dial(struct.pack("!Q", 1 << 20) + b"T")
    assert greedy.recv(1) == b""
    relay.proc.send_signal(signal.SIGINT)  # the stop button's, to the process group: ignored
    relay.connect()
    _, conn = relay.attach(7, b"hello")
    with pytest.raises(ConnectionRefusedError):  # one controller: the listener closed
        relay.dial(b"")
    relay.ctl.sendall(_forward([7], b"payload"))
    assert _recv_exactly(conn, 7) == b"payload"


def test_requests_reach_the_engines_named_handshake_first_and_in_order(relay):
    relay.connect()
    # the open and the first requests in one write: the relay reads them in one go
    listeners = {}
    for ident in range(4):
        listeners[ident], name = relay.engine()
        relay.ctl.sendall(_open(ident, name, b"shake%d" % ident))
    relay.ctl.sendall(
        _forward([0, 1, 2], b"first")
        + _forward([3, 99], b"only three")  # 99 was never opened: skipped
        + _forward([2, 1, 0, 3], b"to all")
        + _forward([1], b"last")
    )
    conns = {ident: relay.keep(listener.accept()[0]) for ident, listener in listeners.items()}
    expected = {
        0: b"shake0firstto all",
        1: b"shake1firstto alllast",
        2: b"shake2firstto all",
        3: b"shake3only threeto all",
    }
    for ident, data in expected.items():
        assert _recv_exactly(conns[ident], len(data)) == data
    relay.ctl.sendall(_msg(b"D", struct.pack("!I", 3)))
    relay.ctl.sendall(_forward([0, 3], b"after"))
    assert _recv_exactly(conns[0], 5) == b"after"
    assert conns[3].recv(100) == b""  # D closed it and took nothing more for it


def test_what_the_engines_write_comes_back_in_order_and_batched(relay):
    relay.connect()
    conns = {ident: relay.attach(ident)[1] for ident in range(8)}
    for i in range(5):
        conns[0].sendall(b"chunk %d;" % i)
    assert relay.received(0, 5 * 8) == b"".join(b"chunk %d;" % i for i in range(5))

    relay.proc.send_signal(signal.SIGSTOP)  # every engine's bytes wait for one turn
    try:
        relay.stopped()
        for ident, conn in conns.items():
            conn.sendall(b"from %d" % ident)
    finally:
        relay.proc.send_signal(signal.SIGCONT)
    first = relay.recv_batch()
    assert len({ident for _, ident, _ in first}) > 1, first  # fewer writes up than engines
    got = collections.defaultdict(bytes)
    while any(len(got[ident]) < 6 for ident in conns):
        kind, ident, data = relay.next()
        assert kind == b"E"
        got[ident] += data
    assert got == {ident: b"from %d" % ident for ident in conns}


def test_the_answers_of_many_engines_asked_at_once_all_come_back(relay):
    """From NAP_FROM engines awaited the relay naps between looks: every answer still comes,
    whole and in order, however they are spread over its naps."""
    relay.connect()
    n = relay_host.NAP_FROM + 4
    conns = {ident: relay.attach(ident)[1] for ident in range(n)}
    relay.ctl.sendall(_forward(list(conns), b"cell"))
    for conn in conns.values():
        assert _recv_exactly(conn, 4) == b"cell"
    for conn in conns.values():  # each engine answers in two writes, a moment apart
        conn.sendall(b"done ")
    time.sleep(relay_host.NAP / 2)
    for ident, conn in conns.items():
        conn.sendall(b"%d;" % ident)
    got = collections.defaultdict(bytes)
    want = {ident: b"done %d;" % ident for ident in conns}
    while any(len(got[ident]) < len(data) for ident, data in want.items()):
        kind, ident, data = relay.next()
        assert kind == b"E"
        got[ident] += data
    assert got == want


def test_an_engine_that_closes_is_reported_after_its_last_bytes(relay):
    relay.connect()
    _, conn = relay.attach(4)
    conn.sendall(b"last words")
    conn.close()
    assert relay.received(4, 10) == b"last words"
    assert relay.next() == (b"C", 4, b"its connection closed")
    relay.ctl.sendall(_forward([4], b"to nobody") + _msg(b"H", struct.pack("!I", 4), b"x"))
    _, other = relay.attach(5)  # the relay went on
    other.sendall(b"still here")
    assert relay.received(5, 10) == b"still here"


def test_an_engine_that_cannot_be_reached_is_reported(relay):
    relay.connect()
    relay.ctl.sendall(_open(9, f"monarch-test-{secrets.token_hex(8)}", b"hello"))
    kind, ident, reason = relay.next()
    assert (kind, ident) == (b"C", 9)
    assert reason.startswith(b"could not connect: ConnectionRefusedError"), reason


def test_a_side_message_goes_on_a_connection_of_its_own(relay):
    relay.connect()
    listener, conn = relay.attach(2, b"hi")
    relay.ctl.sendall(_msg(b"H", struct.pack("!I", 2), b"interrupt please"))
    side = relay.keep(listener.accept()[0])
    assert _recv_exactly(side, 16) == b"interrupt please"
    assert side.recv(1) == b""  # closed behind it
    relay.ctl.sendall(_forward([2], b"main"))
    assert _recv_exactly(conn, 4) == b"main"  # nothing of the side message on the main one


def test_a_second_open_replaces_the_first_and_a_drop_sends_nothing_up(relay):
    relay.connect()
    _, old = relay.attach(1)
    _, new = relay.attach(1, b"again")
    assert old.recv(1) == b""
    relay.ctl.sendall(_msg(b"D", struct.pack("!I", 1)))
    assert new.recv(1) == b""
    relay.ctl.sendall(_open(8, f"monarch-test-{secrets.token_hex(8)}"))
    assert relay.next()[:2] == (b"C", 8)  # the first message up: none for 1


def test_a_large_transfer_to_a_slow_controller_arrives_whole(relay):
    relay.connect(rcvbuf=1 << 16)
    _, conn = relay.attach(3)
    data = os.urandom(64 << 20)
    writer = threading.Thread(target=conn.sendall, args=(data,))
    writer.start()
    try:
        time.sleep(0.5)
        # the relay holds at most 8 MiB and the sockets' buffers: the engine waits in its write
        assert writer.is_alive()
        assert relay.received(3, len(data)) == data
    finally:
        writer.join(10)
    assert not writer.is_alive()
    # 64 MiB went through a relay whose memory stayed bounded: its interpreter, 8 MiB unsent
    # and that batch's copy
    with open(f"/proc/{relay.proc.pid}/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert peak < 40 << 10, f"the relay's resident memory peaked at {peak >> 10} MiB"


def test_the_relay_ends_with_its_controller(relay):
    relay.connect()
    _, conn = relay.attach(0)
    relay.ctl.close()
    assert relay.proc.wait(timeout=5) == 0
    assert conn.recv(1) == b""


def test_a_malformed_message_ends_the_relay(relay):
    relay.connect()
    relay.ctl.sendall(struct.pack("!Q", (1 << 30) + 1) + b"F")
    assert relay.proc.wait(timeout=5) != 0


def test_a_relay_nobody_connects_to_ends():
    relay = Relay({"MONARCH_RELAY_ACCEPT_WITHIN": "0.3"})
    try:
        assert relay.proc.wait(timeout=5) == 0
    finally:
        relay.close()


def test_the_relay_keeps_its_controller_alive_as_the_controller_keeps_it():
    assert relay_host.KEEPALIVE == KEEPALIVE
