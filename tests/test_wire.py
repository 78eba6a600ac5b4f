"""The plain-socket data path: a small request leaves in one send (issue 24: a header sent
apart reached the rank as a segment of its own, which woke its thread for nothing)."""

from __future__ import annotations

import logging
import socket
import threading

from _wait import wait_for

from monarch_nb.wire import FrameConn, accept_forever


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
