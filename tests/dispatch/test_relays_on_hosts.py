"""The relays on other hosts (dispatch/host_relays.py, relay/host.py), driven by the product's
dispatch (benchmarks/fanout_ctl.py) over stand-in ranks (benchmarks/fanout_standin.py), each
host a stand-in process at a loopback address of its own whose ranks tell the controller of a
Unix-domain socket it may not use: the controller reaches them by TCP, the relay started there
by that socket, as on another machine. The real engines behind real relays across network
namespaces: tests/controller/test_host_relays.py."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent.parent / "benchmarks"))

from fanout_ctl import Host, running

from monarch_nb.dispatch.host_relays import HostRelay, RelayedConn
from monarch_nb.dispatch.results import CellError
from monarch_nb.wire import FrameConn

HOSTS, PER_HOST = 3, 4


def far_hosts(first: int = 2) -> list[Host]:
    return [Host(PER_HOST, f"127.0.0.{first + i}", far=True) for i in range(HOSTS)]


@pytest.fixture
def sim():
    hosts = far_hosts()
    with running(hosts) as ctl:
        yield ctl, hosts


def test_each_hosts_ranks_are_reached_through_its_relay(sim):
    ctl, hosts = sim
    assert sorted(ctl._host_relays) == [host.address for host in hosts]
    for link in ctl._links.values():
        assert isinstance(link.conn, RelayedConn)
        assert link.conn.relay is ctl._host_relays[link.info.host]
    # the controller reads one socket per host, none per rank
    assert len(ctl._reader._relays) == HOSTS and not ctl._reader._links
    assert ctl.run("x = rank * 10").to_dict() == dict.fromkeys(range(12))
    assert ctl.run("x + world_size").to_dict() == {r: r * 10 + 12 for r in range(12)}
    assert ctl.run("local_rank", targets=[1, 6, 11]).to_dict() == {1: 1, 6: 2, 11: 3}
    assert not ctl.said


def test_a_relay_killed_mid_cell_loses_and_repeats_nothing(sim):
    ctl, hosts = sim
    ctl.run("n = 0")
    relay: HostRelay = ctl._host_relays[hosts[0].address]
    pid = hosts[0].relays[0]
    # the host's ranks run one after another on its stand-in's loop: rank 0's sleep holds
    # the others' replies (and rank 0's own) until after the kill
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        got = ctl.run("import time\nif local_rank == 0:\n    time.sleep(1.5)\nn += 1\n(rank, n)")
    finally:
        killer.cancel()
    assert got.to_dict() == {r: (r, 1) for r in range(12)}  # every cell ran once, none lost
    assert not relay.alive
    direct = [r for r, link in ctl._links.items() if isinstance(link.conn, FrameConn)]
    assert direct == [0, 1, 2, 3]  # that host's ranks go direct; the other hosts' relays stay
    assert all(isinstance(ctl._links[r].conn, RelayedConn) for r in range(4, 12))
    assert ctl.run("n += 1\nn").to_dict() == dict.fromkeys(range(12), 2)
    assert not ctl.lost


def test_a_malformed_frame_through_a_relay_loses_that_rank_only(sim):
    ctl, hosts = sim
    hosts[1].garbage(1)  # rank 5
    time.sleep(0.3)
    with pytest.raises(CellError) as caught:
        ctl.run("rank")
    assert sorted(caught.value.errors) == [5]
    assert caught.value.errors[5].ename == "WorkerLost"
    assert [(rank, "malformed message" in why) for rank, why in ctl.lost] == [(5, True)]
    assert caught.value.results.to_dict() == {r: r for r in range(12) if r != 5}
    assert ctl._host_relays[hosts[1].address].alive
    assert ctl.run("rank", targets=[4, 6, 7]).to_dict() == {4: 4, 6: 6, 7: 7}


def test_a_relay_that_cannot_start_leaves_its_host_direct_said_once():
    hosts = far_hosts(first=5)
    hosts[1].prefix = ("sh", "-c", "exit 3")  # where its relay would run: nothing listens
    with running(hosts) as ctl:
        assert sorted(ctl._host_relays) == [hosts[0].address, hosts[2].address]
        assert len(ctl.said) == 1
        assert ctl.said[0].startswith(f"no relay on host {hosts[1].address} (RuntimeError: the ")
        assert f"relay exited on {hosts[1].address}, before it said where it listens" in ctl.said[0]
        assert "its ranks are reached directly" in ctl.said[0]
        assert all(isinstance(ctl._links[r].conn, FrameConn) for r in range(4, 8))
        assert ctl.run("rank").to_dict() == {r: r for r in range(12)}


def test_a_frame_that_repeats_the_last_is_read_as_fresh_events():
    """A thousand ranks' identical replies are unpickled once; each rank still gets events of
    its own, and an event holding something mutable is unpickled every time."""
    relay = object.__new__(HostRelay)  # what reads frames, without a relay behind it
    relay.same = None
    done = pickle.dumps([{"ev": "done", "id": "execute-1", "status": "ok"}])
    first = relay._events(done)
    second = relay._events(bytearray(done))
    assert first == second and first[0] is not second[0]
    first[0]["status"] = "changed by its reader"
    assert relay._events(done) == [{"ev": "done", "id": "execute-1", "status": "ok"}]
    failed = pickle.dumps([{"ev": "done", "status": "error", "error": {"ename": "E"}}])
    a, b = relay._events(failed), relay._events(failed)
    assert a == b and a[0]["error"] is not b[0]["error"]
