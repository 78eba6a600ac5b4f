"""The data path between processes on one host (wire.Listeners): a local cluster's ranks and
actors are reached over Unix-domain sockets, a TLS cluster's over TLS only, and a local listener
lets in only this user's processes, and of those only the ones that know the token."""

from __future__ import annotations

import os
import pickle
import socket
import ssl
import threading

import _actor_helpers as helpers
import cloudpickle
import pytest

import monarch_nb
from monarch_nb.actors import mesh as actors
from monarch_nb.wire import HEADER, FrameConn, Listeners, connect_local

cloudpickle.register_pickle_by_value(helpers)

NOBODY = 65534


def _engine_sockets() -> list[str]:
    from monarch_nb.rank.engine import get_engine

    return [c.conn.sock.family.name for c in get_engine().wire.channels.values() if c.conn]


def _actor_sockets() -> list[str]:
    from monarch_nb.actors.worker import current_host

    host = current_host()
    wire = host._wire if host is not None else None  # None until an actor is called here
    channels = wire.channels.values() if wire is not None else ()
    return [c.conn.sock.family.name for c in channels if c.conn]


def _local_name() -> str | None:
    from monarch_nb.rank.engine import get_engine

    return get_engine().wire.listeners.local_name


def test_a_local_clusters_ranks_and_actors_are_reached_over_unix_sockets(ctl):
    assert [link.conn.sock.family for link in ctl._links.values()] == [socket.AF_UNIX] * 2
    assert ctl.client.run(_engine_sockets) == {a: ["AF_UNIX"] for a in ctl.client.run(os.getpid)}
    before = ctl.client.run(_actor_sockets)  # earlier tests' actors may have connected
    pingers = actors.proc_mesh(ctl).spawn("pingers", helpers.Pinger)
    try:
        # the notebook calls both; rank 0's actor calls rank 1's (a worker's own mailbox)
        assert pingers.slice(gpus=0).ping.call_one(pingers, 7).get(timeout=20) == (1, 7)
        families = ctl.client.run(_actor_sockets)
        assert all(f and set(f) == {"AF_UNIX"} for f in families.values()), families
        new = {a: len(f) - len(before.get(a, [])) for a, f in families.items()}
        assert max(new.values()) <= 2, (before, families)  # at most the notebook and rank 0
    finally:
        pingers.stop().get(timeout=10)


def test_a_tls_cluster_has_no_local_listener_and_speaks_tls(no_current):
    tls = monarch_nb.up(workers=2, cpu=True, dist=False, tls=True, current=False)
    try:
        assert set(tls.client.run(_local_name).values()) == {None}
        assert all(isinstance(link.conn.sock, ssl.SSLSocket) for link in tls._links.values())
        assert tls.run("x = 1\nx").values() == [1, 1]
    finally:
        tls.down()


def test_an_engines_local_listener_refuses_a_wrong_token(ctl):
    for address, name in ctl.client.run(_local_name).items():
        sock = connect_local({"local": name, "uid": os.geteuid()}, timeout=5)
        assert sock is not None, f"{address}'s local listener cannot be reached"
        conn = FrameConn(sock)
        conn.send({"controller": "someone", "token": "guessed"})
        sock.settimeout(10)
        assert sock.recv(1) == b"", f"{address} kept a data connection with a wrong token"
        conn.close()
    assert ctl.run("x = 2\nx").values() == [2, 2]  # its controller is unaffected


@pytest.fixture
def listeners():
    hellos: list = []
    arrived = threading.Event()

    def on_hello(conn, hello):
        hellos.append(hello)
        arrived.set()
        conn.close()

    where = Listeners("127.0.0.1", None)
    where.serve(5.0, on_hello, "a test connection", "test-accept")
    return where, hellos, arrived


def _hello_from(name: str, uid: int | None) -> int:
    """In a forked child (as ``uid`` if given): connect to ``name``, say hello, and wait for
    the other side to close. Its exit status: 0 closed, 3 left open, 2 could not connect."""
    frame = pickle.dumps({"from": uid})
    pid = os.fork()
    if pid == 0:  # only sockets and _exit here: the parent has threads
        code = 2
        try:
            if uid is not None:
                os.setgid(uid)
                os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect("\0" + name)
                s.settimeout(10)
                try:
                    s.sendall(HEADER.pack(len(frame)) + frame)
                    code = 0 if s.recv(1) == b"" else 3
                except (BrokenPipeError, ConnectionResetError):  # closed before or unread
                    code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root")
def test_a_local_listener_lets_in_this_users_processes_only(listeners):
    where, hellos, arrived = listeners
    assert _hello_from(where.local_name, NOBODY) == 0  # refused: closed unheard
    assert hellos == []
    assert _hello_from(where.local_name, None) == 0  # this user: heard, then closed by on_hello
    assert arrived.wait(10) and hellos == [{"from": None}]


def test_a_listener_not_there_or_of_another_user_is_passed_over_for_tcp(listeners):
    where, _, _ = listeners
    me = os.geteuid()
    assert connect_local({"local": "monarch-nb-no-such-listener", "uid": me}, 0.0) is None
    assert connect_local({"port": where.port}, timeout=0.0) is None
    # another user's worker on this host would let the connection in, then refuse it: TCP
    assert connect_local({**where.hello(), "uid": me + 1}, timeout=0.0) is None
    sock = connect_local(where.hello(), timeout=0.0)
    assert sock is not None and sock.family == socket.AF_UNIX
    sock.close()
