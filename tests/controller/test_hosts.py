"""Several hosts on one machine: a scheduler and two workers, each in its own network namespace.

The test builds the network itself (tests/_netns.py) and removes it afterwards, whatever
happens::

    root namespace (this test: the controller)  10.77.N.1 ─┐
    mnb-T-sched  (dask scheduler)               10.77.N.10 ─┤ bridge br0 in mnb-T-hub
    mnb-T-w0     (dask worker --nanny, rank 0)  10.77.N.11 ─┤
    mnb-T-w1     (dask worker --nanny, rank 1)  10.77.N.12 ─┘

N is a /24 that no route of this machine uses yet; each namespace also has its own host name
(``unshare --uts``). Every Dask process gets short comm timeouts through DASK_* variables, and the
workers GLOO_SOCKET_IFNAME=eth0: without it gloo takes the address of the machine's host name,
which does not exist inside the namespace, and the process group does not form. Each worker runs
under a shell loop that starts it again when it exits, as a supervisor would on a real cluster.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from _netns import Network, why_not
from _wait import RANK_1_BUSY

import monarch_nb
from monarch_nb import errors as module

# They add links to this machine's own network: make test runs them alone, after the rest
# (a browser sees a network change and drops its requests).
pytestmark = pytest.mark.netns

TCP_TIMEOUT = 11  # s: distributed.comm.timeouts.tcp everywhere here (Dask allows no less than 11)
WORKER_TTL = 5  # s: distributed.scheduler.worker-ttl
SCHEDULER_PORT = 8786  # free by construction: the scheduler's namespace is new
LOST_HOST = 15  # s from a cut link to the cell's end: 4 s of keep-alive probes, and room


class Hosts(Network):
    """A scheduler and two workers; ``hidden``: see the hosts fixture."""

    def __init__(self, logs: Path):
        super().__init__({"sched": 10, "w0": 11, "w1": 12}, logs)
        self.hidden: Path | None = None


@pytest.fixture
def hosts(tmp_path, request):
    """``indirect`` parameter ``{"hidden": True}``: ``hosts.hidden``, a folder of the controller's
    that the worker hosts see as an empty tmpfs of their own (no shared file system)."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    import dask

    h = Hosts(tmp_path)
    saved = module.current()
    module.set_current(None)
    try:
        h.build_or_skip()
        python = sys.executable
        dask_env = {
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": f"{TCP_TIMEOUT}s",
            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": f"{TCP_TIMEOUT}s",
            "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": f"{WORKER_TTL}s",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        dashboard = f"{h.address('sched')}:8787"
        h.dask_scheduler("sched", SCHEDULER_PORT, dask_env, "--dashboard-address", dashboard)
        hide: list[str] = []
        if getattr(request, "param", {}).get("hidden"):
            h.hidden = tmp_path / "controller-only"
            h.hidden.mkdir()
            mount = 'mount -t tmpfs mnb-hidden "$0" && exec "$@"'
            hide = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
            hide.append(str(h.hidden))
        for rank, role in enumerate(("w0", "w1")):
            # As under systemd or a SLURM job step that restarts it: a worker whose scheduler
            # link broke for longer than the timeouts exits, nanny and all, and comes back here.
            h.start(
                role,
                *hide,
                "sh",
                "-c",
                'while :; do "$@"; sleep 0.5; done',
                "supervise",
                python,
                "-m",
                "distributed.cli.dask_worker",
                f"tcp://{h.address('sched')}:{SCHEDULER_PORT}",
                "--nanny",
                "--name",
                str(rank),
                "--nthreads",
                "1",
                "--host",
                h.address(role),
                "--no-dashboard",
                env={**dask_env, "GLOO_SOCKET_IFNAME": "eth0"},
            )
        # The controller's own comms (its links to the engines) give up on a dead peer as fast.
        with dask.config.set({"distributed.comm.timeouts.tcp": f"{TCP_TIMEOUT}s"}):
            yield h
    finally:
        ctl = module.current()
        if ctl is not None:
            with contextlib.suppress(Exception):
                ctl.down()
        module.set_current(saved)
        h.close()


def _cut_after(seconds: float, hosts: Hosts, role: str, at: list[float]) -> threading.Timer:
    def cut():
        at.append(time.monotonic())
        hosts.link(role, "down")

    timer = threading.Timer(seconds, cut)
    timer.start()
    return timer


def test_cluster_across_namespaces_survives_a_cut_link(hosts, cell):
    start = time.monotonic()
    address = f"tcp://{hosts.address('sched')}:{SCHEDULER_PORT}"
    try:
        cell(f"%monarch connect {address} --workers 2 --timeout 30 --wait 60")
    except AssertionError:
        pytest.fail(
            f"connect failed:\n{cell.out}\n{cell.err}\nscheduler log:\n{hosts.log('sched')}\n"
            f"worker logs:\n{hosts.log('w0')}\n{hosts.log('w1')}"
        )
    assert f"connected to 2 ranks at {address}" in cell.out
    assert "\n0     mnb-w0 " in cell.out and "\n1     mnb-w1 " in cell.out
    assert "gloo process group over all ranks" in cell.out
    ctl = monarch_nb.current()

    # Cells on both ranks: each runs on its own host, behind its own address.
    where = cell(
        "%%monarch\nimport socket\nudp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"udp.connect(({hosts.address('sched')!r}, 9))  # no packet: picks the source address\n"
        "(host, udp.getsockname()[0])"
    )
    assert where.values() == [("mnb-w0", hosts.address("w0")), ("mnb-w1", hosts.address("w1"))]
    cell("%monarch status")
    assert "mnb-w0" in cell.out and "mnb-w1" in cell.out and "idle" in cell.out

    # A gloo process group across the hosts.
    reduced = cell(
        "%%monarch\nimport torch, torch.distributed as dist\n"
        "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n(dist.get_world_size(), t.item())"
    )
    assert reduced.values() == [(2, 3.0), (2, 3.0)]

    # Telemetry: logged scalars and device samples reach the controller.
    cell("%%monarch\nfrom monarch_nb import log\nlog(step=0, loss=1.5 + rank)")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        history = monarch_nb.history()
        if len(history) == 2:
            break
        time.sleep(0.2)
    assert {r: [row.values["loss"] for row in rows] for r, rows in history.items()} == {
        0: [1.5],
        1: [2.5],
    }
    latest = ctl.metrics.latest()
    assert [(latest[r]["host"], latest[r]["sample"]["host"]) for r in (0, 1)] == [
        ("mnb-w0", "mnb-w0"),
        ("mnb-w1", "mnb-w1"),
    ]

    # Cut rank 1's link while a cell runs there: the cell ends, naming the rank, no hang.
    cut_at: list[float] = []
    timer = _cut_after(1.5, hosts, "w1", cut_at)
    try:
        cell(RANK_1_BUSY, expect_error=True)
    finally:
        timer.cancel()
    took = time.monotonic() - cut_at[0]
    # its data connection's keep-alive probes go unanswered (dispatch/links.py's KEEPALIVE)
    assert took < LOST_HOST, f"the cell took {took:.1f} s after the cut"
    err = cell.error
    assert isinstance(err, monarch_nb.CellError), repr(err)
    assert list(err.errors) == [1] and err.errors[1].ename == "WorkerLost"
    assert (  # and the worker may live on behind it: restart is the way back
        "the worker is out of reach: its connection timed out: its host no longer answers (if "
        "the host comes back with it, %monarch restart gives every rank a fresh worker"
    ) in err.errors[1].evalue
    assert err.errors[1].host == hosts.address("w1")
    assert err.results.to_dict() == {0: 0}
    assert "1 of 2 ranks failed" in cell.out and "[rank 1] WorkerLost" in cell.out

    # Restore the link once the worker on w1 has lost its scheduler (Dask's comm timeout) and
    # ended, as a dead host's does (or its nanny replaced it); the new one gets rank 1 from the
    # controller. Wait for that, then %monarch restart gives both ranks fresh processes. (A link
    # back sooner finds the old worker: the rank stays lost until a restart, docs/scaling-out.md)
    time.sleep(max(0.0, cut_at[0] + TCP_TIMEOUT + 1 - time.monotonic()))
    hosts.link("w1", "up")
    notices: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any("formed again" in n for n in notices):
        notices += ctl.notices()
        time.sleep(0.2)
    assert f"rank 1 on {hosts.address('w1')} lost its worker" in " ".join(notices), notices
    assert any("replacement worker took its place" in n for n in notices), (
        f"{notices}\nw1 log:\n{hosts.log('w1')}"
    )
    before = cell("%%monarch\nimport os\nos.getpid()").values()
    cell("%monarch restart")
    assert "restarted ranks 0-1" in cell.out
    again = cell(
        "%%monarch\nimport os, torch, torch.distributed as dist\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\n(host, os.getpid(), t.item())"
    )
    assert [(h, v) for h, _, v in again.values()] == [("mnb-w0", 2.0), ("mnb-w1", 2.0)]
    assert not set(before) & {pid for _, pid, _ in again.values()}
    cell("%monarch down")
    assert "disconnected; the cluster keeps running" in cell.out
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("hosts", [{"hidden": True}], indirect=True)
def test_edit_run_loop_without_a_shared_file_system(hosts, cell):
    """``%monarch sync`` and ``%monarch autoreload`` across hosts that cannot see the package:
    the code reaches them over the wire, and an edit reaches the next cell."""
    pkg = hosts.hidden / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def width():\n    return 64\n")
    address = f"tcp://{hosts.address('sched')}:{SCHEDULER_PORT}"
    try:
        cell(f"%monarch connect {address} --workers 2 --timeout 30 --wait 60 --no-dist")
    except AssertionError:
        pytest.fail(f"connect failed:\n{cell.out}\n{cell.err}\n{hosts.log('w0')}")
    seen = cell(f"%%monarch\nimport os\n(host, os.path.exists({str(pkg / 'model.py')!r}))")
    assert seen.values() == [("mnb-w0", False), ("mnb-w1", False)]

    cell(f"%monarch sync {pkg}")
    assert cell.out.strip() == "monarch-nb: sync: sent 2 files (27 B) to ranks 0-1"
    cell("%monarch autoreload on")
    first = cell("%%monarch\nimport trainer.model\n(os.getpid(), trainer.model.width())")
    assert [w for _, w in first.values()] == [64, 64]
    (pkg / "model.py").write_text("def width():\n    return 128\n")
    cell(f"%monarch sync {pkg}")
    assert cell.out.strip() == "monarch-nb: sync: sent 1 file (28 B) to ranks 0-1"
    again = cell("%%monarch\n(os.getpid(), trainer.model.width())")
    assert again.values() == [(pid, 128) for pid, _ in first.values()]
    cell("%monarch down")
