"""Issue 52's simulation harness is faithful: the product's dispatch (benchmarks/fanout_ctl.py)
drives stand-in ranks (benchmarks/fanout_standin.py) as it drives real engines, and their
faults reach it as a real rank's do. Two stand-in processes of four ranks each, as two hosts."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from _wait import wait_for

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fanout_ctl import Host, running

from monarch_nb.dispatch.results import CellError


@pytest.fixture
def sim():
    hosts = [Host(4), Host(4)]
    with running(hosts) as ctl:
        yield ctl, hosts


def test_a_cell_round_trips_with_each_ranks_value(sim):
    ctl, _ = sim
    assert [info.local_rank for info in ctl.ranks] == [0, 1, 2, 3] * 2
    assert ctl.run("x = rank * 10").to_dict() == dict.fromkeys(range(8))
    assert ctl.run("x + world_size").to_dict() == {r: r * 10 + 8 for r in range(8)}
    assert ctl.run("local_rank", targets=[1, 6]).to_dict() == {1: 1, 6: 2}
    assert not ctl.relayed  # 8 ranks: under relaying.RELAY_FROM


def test_a_failing_rank_is_named_and_the_others_values_kept(sim):
    ctl, _ = sim
    with pytest.raises(CellError) as caught:
        ctl.run("1 / (rank - 5)")
    assert list(caught.value.errors) == [5]
    assert caught.value.errors[5].ename == "ZeroDivisionError"
    assert caught.value.results.to_dict() == {r: 1 / (r - 5) for r in range(8) if r != 5}


def test_a_host_killed_mid_cell_loses_its_ranks_only(sim, tmp_path):
    ctl, hosts = sim
    started = tmp_path / "started"
    # rank 0 says it has started, then sleeps, holding its host's event loop (all 4 ranks)
    code = f"import time\nif rank == 0:\n    open({str(started)!r}, 'w').close()\n"
    code += "    time.sleep(30)\nrank"
    threading.Thread(target=_kill_once, args=(hosts[0], started), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(CellError) as caught:
        ctl.run(code, timeout=20)
    assert time.monotonic() - t0 < 10
    errors = caught.value.errors
    assert sorted(errors) == [0, 1, 2, 3]
    assert {e.ename for e in errors.values()} == {"WorkerLost"}
    assert "the worker is gone" in errors[0].evalue
    assert caught.value.results.to_dict() == {r: r for r in range(4, 8)}
    # the links report their loss to the controller just after they end the cell
    assert wait_for(lambda: len(ctl.lost) == 4, timeout=5, interval=0.01), ctl.lost
    assert sorted(rank for rank, _ in ctl.lost) == [0, 1, 2, 3]
    assert ctl.run("rank", targets=[4, 5, 6, 7]).to_dict() == {r: r for r in range(4, 8)}


def _kill_once(host: Host, started: Path) -> None:
    deadline = time.monotonic() + 10
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    host.kill()


def test_a_malformed_frame_loses_that_rank_only(sim):
    ctl, hosts = sim
    hosts[1].garbage(1)  # rank 5
    time.sleep(0.3)
    try:
        ctl.run("rank")
    except CellError as e:
        assert sorted(e.errors) == [5]
        assert e.errors[5].ename == "WorkerLost"
        assert e.results.to_dict() == {r: r for r in range(8) if r != 5}
    else:
        pytest.fail("rank 5 sent a malformed frame and its cell still succeeded")
    assert ctl._reader._thread.is_alive()
