"""The TLS data path under threads, and a setup that cannot complete.

A TLS 1.3 server sends session tickets after the handshake; a client whose reading thread takes
them in while another thread writes used to run OpenSSL's handshake machine in both threads at
once, and a frame vanished (a setup the rank never answered: the notebook hung 300 s) or the
connection broke. Real sockets, real certificates, real OpenSSL."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import threading
import time

import pytest
from _wait import stop
from distributed import Security

import monarch_nb
from monarch_nb.dispatch import links, setup_wait
from monarch_nb.wire import FrameConn


@pytest.fixture(scope="module")
def tls_pair():
    """A TLS listener that serves each connection on a thread of its own (the engine's
    acceptor does the same handshake), and a function that connects a client to it."""
    sec = Security.temporary()
    server_ctx = sec.get_listen_args("worker")["ssl_context"]
    client_ctx = sec.get_connection_args("client")["ssl_context"]
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(sock):
        sock.settimeout(5)
        conn = FrameConn(server_ctx.wrap_socket(sock, server_side=True))
        try:
            conn.recv_one(5)  # the hello
            msgs = list(conn.backlog)
            sel = selectors.DefaultSelector()
            sel.register(conn, selectors.EVENT_READ)
            while not msgs:
                if not sel.select(10):
                    return
                more = conn.feed()
                if more is None:
                    return
                msgs += more
            conn.send([{"echo": msgs[0]}])
            while sel.select(10) and conn.feed() is not None:
                pass  # until the client closes: unread bytes at our close would reset it
        except OSError:
            return
        finally:
            conn.close()

    def accept():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]

    def connect() -> FrameConn:
        sock = socket.create_connection(("127.0.0.1", port))
        conn = FrameConn(client_ctx.wrap_socket(sock, server_hostname=None))
        assert conn.sock.version() == "TLSv1.3"  # the version that sends tickets afterwards
        conn.send({"hello": 1})
        return conn

    yield connect
    listener.close()


class _Watched:
    """The real OpenSSL object of a socket, counting the threads inside it at once."""

    def __init__(self, sslobj):
        self._sslobj = sslobj
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def __getattr__(self, name):
        attr = getattr(self._sslobj, name)
        if name not in ("read", "write", "pending", "shutdown", "do_handshake"):
            return attr

        def call(*args):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            try:
                return attr(*args)
            finally:
                with self._lock:
                    self.inside -= 1

        return call


def _read_until_answer(conn: FrameConn, got: list, done: threading.Event) -> None:
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    try:
        while not done.is_set():
            if not sel.select(0.1):
                continue
            msgs = conn.feed()
            if msgs is None:
                return
            got.extend(msgs)
            if msgs:
                return
    except OSError as e:
        got.append(e)
    finally:
        done.set()


def test_tls_reading_thread_and_writers_never_overlap_in_openssl(tls_pair):
    conn = tls_pair()
    watched = conn.sock._sslobj = _Watched(conn.sock._sslobj)
    got: list = []
    done = threading.Event()
    reader = threading.Thread(target=_read_until_answer, args=(conn, got, done), daemon=True)
    reader.start()
    time.sleep(0.5)  # the tickets have come: the reading thread has taken them in
    for i in range(20):  # from threads other than the reader, as the notebook's thread posts
        conn.post({"op": "setup", "i": i})
    assert done.wait(10), "the server's answer never came back"
    reader.join(5)
    conn.close()
    assert got == [[{"echo": {"op": "setup", "i": 0}}]]
    assert watched.most == 1, "two threads were inside one OpenSSL object at once"


def test_tls_frames_posted_during_the_tickets_all_arrive(tls_pair):
    """The failure itself, many times: post right after the handshake while the reading
    thread takes in the tickets. Before the fix ~1 in 150 of these lost its frame under load."""
    lost = []
    for i in range(150):
        conn = tls_pair()
        got: list = []
        done = threading.Event()
        threading.Thread(target=_read_until_answer, args=(conn, got, done), daemon=True).start()
        conn.post({"op": "setup", "i": i})
        if not done.wait(10) or got != [[{"echo": {"op": "setup", "i": i}}]]:
            lost.append((i, got))
        conn.close()
    assert not lost


def test_a_tls_post_with_room_is_written_at_once_without_a_thread(tls_pair, monkeypatch):
    """Every request on a TLS cluster went through a thread started for it (a call cost
    several times a plain one); now only what the socket cannot take does."""
    handed: list = []
    monkeypatch.setattr(FrameConn, "_write_unsent", lambda self: handed.append(self))
    conn = tls_pair()
    got: list = []
    done = threading.Event()
    threading.Thread(target=_read_until_answer, args=(conn, got, done), daemon=True).start()
    conn.post({"op": "setup", "i": 1})
    assert done.wait(10) and got == [[{"echo": {"op": "setup", "i": 1}}]]
    assert handed == []
    conn.close()


def test_a_setup_that_never_arrives_fails_in_seconds_naming_the_rank(no_current, monkeypatch):
    monkeypatch.setattr(setup_wait, "PROBE_EVERY", 1.0)
    first = monarch_nb.up(workers=1, cpu=True, dist=False, tls=True, current=False)
    try:
        send = links.Link.send

        def lose_setup(link, msg, *framed):  # the data path losing the frame, as the TLS race did
            if msg.get("op") != "setup":
                send(link, msg, *framed)

        monkeypatch.setattr(links.Link, "send", lose_setup)
        start = time.monotonic()
        with pytest.raises(monarch_nb.ClusterError) as err:
            monarch_nb.connect(first.scheduler_address, tls=first.client.security, dist=False)
        took = time.monotonic() - start
        assert "\n" not in str(err.value)
        assert str(err.value).startswith("rank 0 failed to start its engine: "), err.value
        assert "never received the setup request" in str(err.value)
        assert took < 60, took
        monkeypatch.setattr(links.Link, "send", send)
        assert first.run("rank").values() == [0]  # the first controller is unaffected
    finally:
        first.down()


def test_a_setup_behind_another_controllers_cell_is_waited_for(no_current, monkeypatch):
    monkeypatch.setattr(setup_wait, "PROBE_EVERY", 0.5)
    first = monarch_nb.up(workers=1, cpu=True, dist=False, tls=True, current=False)
    try:
        handle = first.run("import time\ntime.sleep(6)\n'slept'", block=False)
        time.sleep(1)  # the rank's thread runs the first controller's cell
        second = monarch_nb.connect(
            first.scheduler_address, tls=first.client.security, dist=False, current=False
        )
        try:
            assert handle.result().values() == ["slept"]
            assert second.run("rank").values() == [0]
        finally:
            second.down()
    finally:
        first.down()


def test_a_worker_that_stops_during_setup_is_reported_not_waited_for(no_current, monkeypatch):
    monkeypatch.setattr(setup_wait, "PROBE_EVERY", 1.0)
    monkeypatch.setattr(setup_wait, "ANSWER_WITHIN", 3.0)
    first = monarch_nb.up(workers=1, cpu=True, dist=False, tls=True, current=False)
    pid = first.status()[0]["pid"]
    send = links.Link.send

    def stop_then_send(link, msg, *framed):
        if msg.get("op") == "setup":
            stop(pid)  # the worker stops as its setup is on its way
        send(link, msg, *framed)

    try:
        monkeypatch.setattr(links.Link, "send", stop_then_send)
        with pytest.raises(monarch_nb.ClusterError) as err:
            monarch_nb.connect(first.scheduler_address, tls=first.client.security, dist=False)
        assert str(err.value).startswith("rank 0 failed to start its engine: neither its setup")
    finally:
        os.kill(pid, signal.SIGCONT)
        monkeypatch.setattr(links.Link, "send", send)
        first.down()
