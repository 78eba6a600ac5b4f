"""The request relay (dispatch/relaying.py, relay/main.py): from RELAY_FROM ranks on the
controller's host, a request is written once, to the relay, which writes it to every engine.
Each rank's requests keep their order; a relay that ends leaves no cell behind or run twice; an
engine drops the second copy of a cell, whichever copy comes first."""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import monarch_nb
from monarch_nb.dispatch import relaying
from monarch_nb.rank.engine_io import Channel
from monarch_nb.relay import main as relay_main


@pytest.fixture
def relayed(monkeypatch):
    """A 3-rank cluster of its own whose requests go through a relay."""
    monkeypatch.setattr(relaying, "RELAY_FROM", 3)
    ctl = monarch_nb.up(workers=3, cpu=True, dist=False, current=False)
    yield ctl
    ctl.down()


def test_a_small_cluster_sends_directly(clean):
    assert clean._relay is None and all(link.relay is None for link in clean._links.values())


def test_each_rank_gets_its_requests_in_order_through_the_relay(relayed, capsys):
    relay = relayed._relay
    assert relay is not None and relay.alive
    assert all(link.relay is relay for link in relayed._links.values())
    relayed.run("seen = []")
    handles = []
    for i in range(30):  # cells to every rank, to one rank, and calls, none waited for
        if i % 3 == 1:
            handles.append(relayed.run(f"seen.append({i})", targets=1, block=False))
        else:
            handles.append(relayed.run(f"seen.append({i})", block=False))
    for handle in handles:
        handle.result(timeout=60)
    everyone = [i for i in range(30) if i % 3 != 1]
    assert relayed.run("seen").values() == [everyone, list(range(30)), everyone]
    relayed.run("print('line', rank)")
    assert sorted(capsys.readouterr().out.split("\n")[:3]) == [
        f"[rank {r}] line {r}" for r in range(3)
    ]

    relayed.scale(4)  # a rank that joins goes behind the relay too
    assert relayed._links[3].relay is relay
    assert relayed.run("rank").values() == [0, 1, 2, 3]


def test_ctrl_c_and_status_reach_relayed_ranks(relayed):
    handle = relayed.run("while True: pass", block=False)
    deadline = time.monotonic() + 10
    while not all(r["state"].startswith("busy") for r in relayed.status()):
        assert time.monotonic() < deadline, relayed.status()
        time.sleep(0.05)
    assert str(relayed.interrupt(wait=True)) == "interrupted ranks 0-2"
    with pytest.raises(monarch_nb.CellError, match="KeyboardInterrupt"):
        handle.result(timeout=30)
    assert relayed.run("rank").values() == [0, 1, 2]


def test_a_killed_relay_leaves_no_cell_behind_and_runs_none_twice(relayed):
    relayed.run("seen = []")
    slow = relayed.run("import time\ntime.sleep(1)\nseen.append('slow')", block=False)
    relay = relayed._relay.proc
    relay.send_signal(signal.SIGSTOP)  # what it takes from now on, it never delivers
    queued = [relayed.run(f"seen.append({i})", block=False) for i in range(5)]
    relay.kill()
    for handle in [slow, *queued]:
        handle.result(timeout=60)
    assert relayed.run("seen").values() == [["slow", 0, 1, 2, 3, 4]] * 3
    deadline = time.monotonic() + 10
    while any(link.relay is not None for link in relayed._links.values()):
        assert time.monotonic() < deadline, "the links still point at the ended relay"
        time.sleep(0.05)
    assert relayed.run("rank").values() == [0, 1, 2]  # directly from now on


def test_an_engine_drops_the_second_copy_of_a_cell_whichever_comes_first():
    channel = Channel(SimpleNamespace(poke=lambda: None), "controller", None)
    cell = {"op": "execute", "id": "execute-1-abc", "code": "x += 1"}
    assert channel.fresh(cell)
    assert not channel.fresh({**cell, "resent": True})
    assert channel.fresh({**cell, "resent": True, "id": "execute-2-abc"})
    assert not channel.fresh({**cell, "id": "execute-2-abc"})  # the original, after its copy
    answer = {"op": "input_reply", "id": "execute-1-abc", "value": "y"}
    assert channel.fresh(answer) and channel.fresh(answer)  # a cell's answers are not copies


def _relay_process():
    frames, frames_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    adds, adds_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = (frames_there.fileno(), adds_there.fileno())
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", relay_main.__file__, *map(str, fds)], pass_fds=fds
    )
    frames_there.close()
    adds_there.close()
    return proc, frames, adds


def _forward(frames: socket.socket, ids: list[int], data: bytes) -> None:
    head = struct.pack(f"!cI{len(ids)}I", b"F", len(ids), *ids)
    frames.sendall(struct.pack("!Q", len(head) + len(data)) + head + data)


def test_the_relay_process_writes_to_every_target_and_a_full_one_holds_back_no_other():
    proc, frames, adds = _relay_process()
    try:
        engines = {}
        for ident in (1, 2, 3):
            here, there = socket.socketpair()
            socket.send_fds(adds, [b"A" + struct.pack("!I", ident)], [there.fileno()])
            there.close()
            here.settimeout(10)
            engines[ident] = here
        big = bytes(4 << 20)  # more than a socket holds: engine 3 reads none of it yet
        _forward(frames, [3], big)
        _forward(frames, [1, 2], b"to one and two")
        assert engines[1].recv(100) == b"to one and two"
        assert engines[2].recv(100) == b"to one and two"
        adds.send(b"D" + struct.pack("!I", 2))
        assert engines[2].recv(100) == b""  # closed by the relay
        _forward(frames, [1, 2], b"after the drop")
        assert engines[1].recv(100) == b"after the drop"
        proc.send_signal(signal.SIGINT)  # the stop button's, to the kernel's process group
        got = 0
        while got < len(big):
            got += len(engines[3].recv(1 << 20))
        frames.close()  # the controller's end: the relay ends
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
