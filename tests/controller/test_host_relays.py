"""A relay on every host (dispatch/host_relays.py, relay/host.py): three hosts of four ranks
each, every host a network namespace of its own (tests/_netns.py), as tests/controller/
test_hosts.py builds them::

    root namespace (this test: the controller)  10.77.N.1  ─┐
    mnb-T-sched  (dask scheduler)               10.77.N.10 ─┤ bridge br0 in mnb-T-hub
    mnb-T-h0     (dask worker --nworkers 4)     10.77.N.11 ─┤
    mnb-T-h1     (dask worker --nworkers 4)     10.77.N.12 ─┤
    mnb-T-h2     (dask worker --nworkers 4)     10.77.N.13 ─┘

From the controller's namespace a rank is reached by TCP only, as on another machine; the relay
that a worker starts on its host reaches the engines there by their Unix-domain sockets. In
order, on one cluster: cells, merged output, status, stacks and an interrupt through the relays; one
host's relay killed mid-cell (its ranks go direct, nothing lost or run twice); one host cut off
mid-cell (its ranks lost, named in one line, the others' values kept).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
from _netns import Network, why_not
from _wait import wait_for

import monarch_nb
from monarch_nb import errors as module
from monarch_nb.dispatch.host_relays import RelayedConn
from monarch_nb.wire import FrameConn

pytestmark = pytest.mark.netns  # make test runs them alone, after the rest (test_hosts.py)

TCP_TIMEOUT = 11  # s: distributed.comm.timeouts.tcp everywhere here (Dask allows no less than 11)
SCHEDULER_PORT = 8786
PER_HOST = 4
HOSTS = ("h0", "h1", "h2")
LOST_HOST = 15  # s from a cut link to the cell's end: 4 s of keep-alive probes, and room
WAIT = 150  # s for the twelve workers to join: they import torch on two cores


@pytest.fixture
def hosts(tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    import dask

    net = Network({"sched": 10, "h0": 11, "h1": 12, "h2": 13}, tmp_path)
    saved = module.current()
    module.set_current(None)
    try:
        net.build_or_skip()
        env = {
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": f"{TCP_TIMEOUT}s",
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": f"{TCP_TIMEOUT}s",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        sched = net.address("sched")
        net.dask_scheduler("sched", SCHEDULER_PORT, env, "--no-dashboard")
        for role in HOSTS:
            net.start(
                role,
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                f"tcp://{sched}:{SCHEDULER_PORT}",
                "--nanny",
                "--nworkers",
                str(PER_HOST),
                "--nthreads",
                "1",
                "--host",
                net.address(role),
                "--no-dashboard",
                env=env,
            )
        with dask.config.set({"distributed.comm.timeouts.tcp": f"{TCP_TIMEOUT}s"}):
            yield net
    finally:
        ctl = module.current()
        if ctl is not None:
            ctl.down()
        module.set_current(saved)
        net.close()


def test_every_hosts_ranks_through_its_relay(hosts, cell):
    n = PER_HOST * len(HOSTS)
    address = f"tcp://{hosts.address('sched')}:{SCHEDULER_PORT}"
    try:
        cell(f"%monarch connect {address} --workers {n} --timeout 30 --wait {WAIT} --no-dist")
    except AssertionError:
        logs = "\n".join(f"{role}:\n{hosts.log(role)}" for role in ("sched", *HOSTS))
        pytest.fail(f"connect failed:\n{cell.out}\n{cell.err}\n{logs}")
    ctl = monarch_nb.current()
    on = {role: [i.rank for i in ctl.ranks if i.host == hosts.address(role)] for role in HOSTS}
    assert sorted(len(ranks) for ranks in on.values()) == [PER_HOST] * len(HOSTS), on

    # 1. One relay per host, and every rank behind its host's: the kernel reads three sockets.
    assert sorted(ctl._host_relays) == sorted(hosts.address(role) for role in HOSTS)
    assert all(isinstance(link.conn, RelayedConn) for link in ctl._links.values())
    assert len(ctl._reader._relays) == len(HOSTS) and not ctl._reader._links
    where = cell("%%monarch\nprint('the same line')\nhost").to_dict()
    assert where == {r: f"mnb-{role}" for role, ranks in on.items() for r in ranks}
    assert cell.out.count("the same line") == 1, cell.out  # twelve ranks, one merged line

    # 2. Status names each rank's host; stacks and an interrupt reach every rank through the
    # relays.
    cell("%monarch status")
    assert all(f"mnb-{role}" in cell.out for role in HOSTS), cell.out
    handle = cell("%%monarch --noblock\nwhile True: pass")
    assert wait_for(lambda: len(ctl._router.busy()) == n, 20)
    report = ctl.stacks()  # asked on each rank's event loop, answered through its relay
    assert sorted(report.ranks) == list(range(n)) and not report.silent, report.silent
    cell("%monarch interrupt")
    with pytest.raises(monarch_nb.CellError, match="KeyboardInterrupt") as caught:
        handle.result(timeout=10)
    assert sorted(caught.value.errors) == list(range(n))

    # 3. A relay killed mid-cell: its host's ranks go direct, each line and value arrives once.
    relay = ctl._host_relays[hosts.address("h1")]
    killer = threading.Timer(1.0, os.kill, (relay.pid, signal.SIGKILL))
    killer.start()
    try:
        got = cell(
            "%%monarch\nimport time\ncount = globals().get('count', 0) + 1\n"
            "for i in range(4):\n    print('step', i)\n    time.sleep(0.5)\ncount"
        )
    finally:
        killer.cancel()
    assert got.values() == [1] * n  # each rank ran the cell once
    for i in range(4):  # and each rank's every line came once, alone or merged with others'
        said = [_ranks(ln) for ln in cell.out.splitlines() if ln.endswith(f"] step {i}")]
        assert sorted(r for ranks in said for r in ranks) == list(range(n)), cell.out
    assert not relay.alive
    assert all(isinstance(ctl._links[r].conn, FrameConn) for r in on["h1"])
    assert all(isinstance(ctl._links[r].conn, RelayedConn) for r in on["h0"] + on["h2"])

    # 4. A host cut off mid-cell: its ranks lost, one line for the host; the others' values.
    lost = on["h2"]
    cut_at: list[float] = []
    timer = threading.Timer(
        1.5, lambda: (cut_at.append(time.monotonic()), hosts.link("h2", "down"))
    )
    timer.start()
    try:
        cell(
            f"%%monarch\nimport time\nif rank in {lost}:\n    time.sleep(60)\nrank",
            expect_error=True,
        )
    finally:
        timer.cancel()
    took = time.monotonic() - cut_at[0]
    assert took < LOST_HOST, f"the cell took {took:.1f} s after the cut"
    err = cell.error
    assert sorted(err.errors) == lost and {e.ename for e in err.errors.values()} == {"WorkerLost"}
    assert err.results.to_dict() == {r: r for r in range(n) if r not in lost}
    lines = [ln for ln in cell.out.splitlines() if "WorkerLost" in ln]
    assert len(lines) == 1 and "out of reach" in lines[0], cell.out


def _ranks(line: str) -> list[int]:
    """The ranks an output line is tagged with: ``[rank 3]``, ``[ranks 0-2,5]``."""
    spec = line[1 : line.index("]")].removeprefix("ranks ").removeprefix("rank ")
    ranks = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        ranks += range(int(low), int(high or low) + 1)
    return ranks
