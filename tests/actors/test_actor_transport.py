"""The data sockets actor messages travel on (actors/transport.py, actors/mailbox.py):
broadcasts that wait to go out together still go without a call after them, TLS on a TLS
cluster for the notebook's calls and for actors calling actors, and a listener that takes only
callers who attached first."""

from __future__ import annotations

import socket
import ssl
import time

import _actor_helpers as helpers
import cloudpickle
import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb.actors import mesh as actors
from monarch_nb.actors.worker import current_host
from monarch_nb.wire import FrameConn

cloudpickle.register_pickle_by_value(helpers)


def _listeners(ctl) -> dict[str, int]:
    """Worker address -> the port its actor data sockets are accepted on."""
    return ctl.client.run(lambda: current_host()._wire.listeners.port)


def _closed_by_peer(sock: socket.socket, timeout: float = 10) -> bool:
    """Whether the other side ends the connection (within ``timeout`` seconds) instead of
    answering or waiting."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_a_broadcast_with_no_call_after_it_still_goes_out(ctl, capsys):
    talker = actors.proc_mesh(ctl).spawn("talker", helpers.Talker)
    out = []
    try:
        capsys.readouterr()
        talker.talk.broadcast(1)  # what it prints comes back without any call to flush it

        def printed() -> bool:
            out.append(capsys.readouterr().out)
            return all(f"[talker rank {r}] line 0" in "".join(out) for r in (0, 1))

        assert wait_for(printed, timeout=10, interval=0.05), "".join(out)
    finally:
        talker.stop().get(timeout=10)


@pytest.fixture(scope="module")
def tls_cluster():
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False, tls=True, current=False)
    try:
        yield ctl
    finally:
        ctl.down()


def test_actor_messages_travel_over_tls_on_a_tls_cluster(tls_cluster, capsys):
    mesh = actors.proc_mesh(tls_cluster)
    counters = mesh.spawn("counters", helpers.Counter, 10)
    pingers = mesh.spawn("pingers", helpers.Pinger)
    talker = mesh.spawn("talker", helpers.Talker)
    try:
        capsys.readouterr()
        assert talker.talk.call(1).get(timeout=20).values() == [1, 1]
        out = capsys.readouterr().out.splitlines()
        assert "[talker rank 1] line 0" in out and "[talker rank 0] unfinished" in out
        for i in range(200):
            counters.push.broadcast(i)
        assert counters.pulled.call().get(timeout=20).values() == [list(range(200))] * 2
        assert counters.incr.call(5).get(timeout=20).values() == [15, 15]
        # An actor's own mailbox wraps its sockets too.
        assert pingers.slice(gpus=0).ping.call_one(pingers, 7).get(timeout=20) == (1, 7)
    finally:
        counters.stop().get(timeout=10)
        pingers.stop().get(timeout=10)
        talker.stop().get(timeout=10)


def test_the_actor_listener_refuses_plain_tcp_and_a_wrong_token(tls_cluster):
    mesh = actors.proc_mesh(tls_cluster)
    counters = mesh.spawn("counters", helpers.Counter)  # every worker listens from now on
    try:
        for address, port in _listeners(tls_cluster).items():
            host = address.split("://", 1)[-1].rsplit(":", 1)[0]
            plain = socket.create_connection((host, port), timeout=5)
            with plain:
                plain.sendall(b"\0" * 8)  # a frame header, where a TLS handshake belongs
                assert _closed_by_peer(plain)

            context = tls_cluster.client.connection_args["ssl_context"]
            sock = context.wrap_socket(
                socket.create_connection((host, port), timeout=5), server_hostname=None
            )
            conn = FrameConn(sock)
            conn.send({"caller": "someone", "token": "guessed"})
            start = time.monotonic()
            while time.monotonic() - start < 10:
                try:
                    if conn.feed() is None:
                        break
                except (ConnectionResetError, ssl.SSLError):
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"{address} kept a data connection with a wrong token")
            conn.close()
        assert counters.incr.call().get(timeout=20).values() == [1, 1]  # callers unaffected
    finally:
        counters.stop().get(timeout=10)
