"""The plain-socket data path: a small request leaves in one send (issue 24: a header sent
apart reached the rank as a segment of its own, which woke its thread for nothing)."""

from __future__ import annotations

import logging
import select
import socket
import threading

import pytest
from _wait import wait_for

from monarch_nb.wire import HEADER, FrameConn, MalformedMessage, accept_forever, frame


class CountingSocket(socket.socket):
    """A real TCP socket that remembers what each send() was given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sends: list[bytes] = []

    def send(self, data, flags=0):
        self.sends.append(bytes(data))
        return super().send(data, flags)


def _pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = CountingSocket(socket.AF_INET, socket.SOCK_STREAM)
    client.connect(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


def test_a_small_request_is_one_send_and_arrives_whole():
    client, server = _pair()
    sender, receiver = FrameConn(client), FrameConn(server)
    try:
        sender.post({"op": "execute", "code": "x = 1", "id": "execute-1-abc"})
        assert len(client.sends) == 1
        got = []
        while not got:
            got = receiver.feed()
        assert got == [{"op": "execute", "code": "x = 1", "id": "execute-1-abc"}]
    finally:
        sender.close()
        receiver.close()


def test_a_large_request_still_arrives_whole():
    client, server = _pair()
    sender, receiver = FrameConn(client), FrameConn(server)
    blob = bytes(range(256)) * 4096  # 1 MiB: past what one frame's send is given
    try:
        sender.post({"blob": blob})
        got = []
        while not got:
            got = receiver.feed()
        assert got == [{"blob": blob}]
    finally:
        sender.close()
        receiver.close()


def test_reading_a_message_does_not_allocate_a_read_buffer_each_time():
    # recv(MAX_READ) allocated 1 MiB per message (an mmap, an mremap and an munmap, which in
    # a process with many threads flushes the other cores' TLBs): a tenth of a round trip.
    import tracemalloc

    client, server = _pair()
    sender, receiver = FrameConn(client), FrameConn(server)
    try:
        for i in range(2):  # the first read may make this thread's buffer
            if i == 1:
                tracemalloc.start()
            sender.post({"op": "execute", "code": "x = 1", "id": f"execute-{i}-abc"})
            got = []
            while not got:
                got = receiver.feed()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert got == [{"op": "execute", "code": "x = 1", "id": "execute-1-abc"}]
        assert peak < 64 * 1024, peak
    finally:
        sender.close()
        receiver.close()


def test_a_data_listener_hangs_up_on_a_first_frame_that_claims_too_much(caplog):
    # A stranger's banner is read as the length of a handshake: "SSH-2.0-" claims 5.21 EiB,
    # which the listener waited for, buffering whatever came, until its handshake timeout.
    caplog.set_level(logging.INFO, logger="monarch_nb")
    listener = socket.create_server(("127.0.0.1", 0))
    hellos = []
    threading.Thread(
        target=accept_forever,
        args=(listener, None, 30, lambda conn, hello: hellos.append(hello), "a test connection"),
        daemon=True,
    ).start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            assert sock.recv(1) == b""  # hung up on, well before the 30 s of a handshake
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            FrameConn(sock).send({"token": "t"})  # a handshake is taken as before
            assert wait_for(lambda: hellos == [{"token": "t"}], timeout=10)
    finally:
        listener.close()
    assert (
        "refused a test connection: its first bytes (SSH-2.0-) claim a message of 5.21 EiB; "
        "a handshake is 64 KiB at most"
    ) in caplog.text


class Called(Exception):
    """Raised by what a malicious pickle names: the test fails if it ever runs."""


def _calls(*args):
    raise Called(args)


class Payload:
    """A pickle that calls ``_calls`` as it is read: what a stranger would send to run code."""

    def __reduce__(self):
        return _calls, ("ran",)


def _accepting(listener, hellos: list) -> None:
    def on_hello(conn, hello):
        hellos.append((hello, conn))

    threading.Thread(
        target=accept_forever,
        args=(listener, None, 30, on_hello, "a test connection"),
        daemon=True,
    ).start()


def test_a_handshake_is_plain_data_and_what_follows_it_waits_for_its_check(caplog):
    """Before a peer has shown its token nothing it sent is imported or called: a handshake that
    names a function is refused, and messages sent behind a handshake are read only once the
    taker, having checked it, asks for its backlog."""
    caplog.set_level(logging.INFO, logger="monarch_nb")
    listener = socket.create_server(("127.0.0.1", 0))
    hellos: list = []
    _accepting(listener, hellos)
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            FrameConn(sock).send(Payload())
            assert sock.recv(1) == b""  # hung up on
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            client = FrameConn(sock)
            client.post_frame((*frame({"token": "t"}), *frame(Payload()), *frame({"op": "next"})))
            assert wait_for(lambda: len(hellos) == 1, timeout=10)
            hello, conn = hellos[0]
            assert hello == {"token": "t"}  # and the payload behind it has not run
            with pytest.raises(MalformedMessage, match="Called"):  # read, and run, only now
                conn.backlog  # noqa: B018 (what the first read took in behind the handshake)
                while select.select([conn.sock], [], [], 10)[0]:  # or what came after
                    conn.feed()
    finally:
        listener.close()
    assert (
        "refused a test connection: it sent a malformed message (UnpicklingError: a handshake "
        f"names {__name__}._calls: only plain data is)"
    ) in caplog.text


def test_a_malformed_message_gives_the_connection_up_with_why():
    client, server = _pair()
    try:
        client.sendall(HEADER.pack(3) + b"\xff\x00\xff")
        assert select.select([server], [], [], 10)[0]
        with pytest.raises(MalformedMessage, match=r"it sent a malformed message \(Unpickling"):
            FrameConn(server).feed()
    finally:
        client.close()
        server.close()
