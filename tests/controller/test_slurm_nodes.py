"""A real Slurm of three nodes (tests/_slurm_nodes.py): slurmctld and munged in the root namespace,
a slurmd in each of three network-namespace hosts, ranks submitted by dask-jobqueue's
SLURMCluster and spread one per node by the partition. One Slurm and one cluster of three ranks
for the whole module, in this order: cells and a gloo all_reduce across the nodes; a node killed
mid-cell and ``%monarch scale`` starting its rank again on one of the two nodes left; the link
to a node cut mid-cell.

Skipped, in one line, only where Slurm is not installed, the test is not root or the machine
cannot make network namespaces; where they can, a Slurm that does not come up fails the test.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import time

import _netns
import _slurm
import _slurm_nodes
import pytest
from _slurm_nodes import NODES, SlurmNodes, node_name
from _wait import wait_for

import monarch_nb
from monarch_nb import errors as module

# They add links to this machine's own network: make test runs them alone, after the rest
# (a browser sees a network change and drops its requests).
pytestmark = pytest.mark.netns

TCP_TIMEOUT = 11  # s: distributed.comm.timeouts.tcp everywhere here (Dask allows no less than 11)
WORKER_TTL = 5  # s: distributed.scheduler.worker-ttl (the scheduler is the notebook's)
LOST_HOST = 15  # s from a cut link to the cell's end: 4 s of keep-alive probes, and room
WAIT = 120  # s for the jobs' workers to join: three workers importing torch on two cores


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = _slurm.why_not() or _netns.why_not()
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec("dask_jobqueue") is None:
        pytest.skip("dask-jobqueue is not installed (the dev extra)")
    import dask

    network = _netns.Network(NODES, tmp_path_factory.mktemp("slurm-nodes"))
    s = SlurmNodes(network)
    with pytest.MonkeyPatch.context() as mp:
        # for sbatch, squeue and scancel; the jobs get this environment (sbatch --export=ALL):
        # the workers' Dask gives up on a lost peer as soon as Dask allows
        mp.setenv("SLURM_CONF", str(s.conf))
        mp.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP", f"{TCP_TIMEOUT}s")
        mp.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", f"{TCP_TIMEOUT}s")
        mp.setattr(_slurm_nodes, "scheduler_host", network.gateway)
        try:
            network.build()
            s.start()
        except Exception as e:
            s.stop()
            network.close()
            pytest.fail(f"the three-node Slurm did not come up: {e}")
        # The scheduler (the notebook's, as SLURMCluster starts it) and the controller's links.
        timeouts = {
            "distributed.comm.timeouts.tcp": f"{TCP_TIMEOUT}s",
            "distributed.comm.timeouts.connect": f"{TCP_TIMEOUT}s",
            "distributed.scheduler.worker-ttl": f"{WORKER_TTL}s",
        }
        try:
            with dask.config.set(timeouts):
                yield s
        finally:
            left = s.stop()
            network.close()
    assert left == [], f"processes of the test Slurm left running: {left}"


@pytest.fixture(scope="module")
def ranks(slurm):
    """Three ranks, three Slurm jobs; shut down after the module's last test."""
    try:
        ctl = monarch_nb.connect(
            cluster="_slurm_nodes:make_cluster", workers=3, wait=WAIT, current=False
        )
    except Exception as e:
        pytest.fail(f"connect failed: {e}\n{slurm.squeue()}\n{slurm.log()}")
    yield ctl
    ctl.down()


@pytest.fixture
def site(ranks):
    """The three-rank cluster, current for the test's cells."""
    saved = module.current()
    module.set_current(ranks)
    yield ranks
    module.set_current(saved)


ALL_REDUCE = (
    "%%monarch\nimport torch, torch.distributed as dist\n"
    "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n(dist.get_world_size(), t.item())"
)


def _busy(rank: int) -> str:
    """A cell that keeps ``rank`` busy for up to 120 s while the others return their rank."""
    return (
        "%%monarch\nimport time\nt0 = time.time()\n"
        f"while rank == {rank} and time.time() - t0 < 120:\n    time.sleep(0.05)\nrank"
    )


def _placement(cell, slurm, network) -> list[tuple[str, str]]:
    """Each rank's (node, job id), checked against its host name, address and Slurm's queue."""
    rows = cell(
        "%%monarch\nimport os, socket\n"
        "udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"udp.connect(({network.gateway!r}, 9))  # no packet: picks the source address\n"
        "(host, os.environ['SLURMD_NODENAME'], os.environ['SLURM_JOB_ID'], "
        "udp.getsockname()[0])"
    ).values()
    queue = slurm.job_nodes()
    by_node = {node_name(role): role for role in NODES}
    for host, node, job, address in rows:
        assert host == node and address == network.address(by_node[node]), rows
        assert queue[job] == node, (rows, queue)
    return [(node, job) for _, node, job, _ in rows]


def test_ranks_are_jobs_on_three_nodes(slurm, site, cell):
    network = slurm.network
    placed = _placement(cell, slurm, network)
    assert sorted(node for node, _ in placed) == sorted(node_name(r) for r in NODES), placed
    jobs = {name: job.job_id for name, job in site.cluster.workers.items()}
    assert [job for _, job in placed] == [jobs[0], jobs[1], jobs[2]]
    assert [info.host for info in site.ranks] == [network.address(role) for role in _roles(placed)]
    # gloo across the three nodes, on their shared interface (GLOO_SOCKET_IFNAME=eth0)
    assert cell(ALL_REDUCE).values() == [(3, 6.0)] * 3


def test_a_node_killed_mid_cell_and_its_rank_started_again(slurm, site, cell):
    """The node of rank 1 dies (its slurmd, job and worker SIGKILLed): that rank's WorkerLost
    in one line, the others' values kept. No nanny starts a Slurm job again: ``%monarch scale
    3`` (the same size) submits rank 1's job again, which Slurm puts on one of the two nodes
    left, and rank 1 takes its place; ``%monarch scale 2`` and ``3`` then drop and add the
    highest rank as usual."""
    network = slurm.network
    placed = _placement(cell, slurm, network)
    dead = _roles(placed)[1]
    timer = threading.Timer(1.5, slurm.kill_node, (dead,))
    timer.start()
    try:
        cell(_busy(1), expect_error=True)
    finally:
        timer.cancel()
    err = cell.error
    assert isinstance(err, monarch_nb.CellError), repr(err)
    assert err.results.to_dict() == {0: 0, 2: 2}
    lines = err._render_traceback_()
    assert lines[:2] == ["1 of 3 ranks failed", ""], lines
    assert len(lines) == 3 and lines[2].startswith(
        f"[rank 1] WorkerLost: on {network.address(dead)}: "
    ), lines
    assert lines[2].endswith(
        "(if no replacement joins, %monarch scale with the same number of ranks starts one)"
    ), lines
    assert "1 of 3 ranks failed" in cell.out and "[rank 1] WorkerLost" in cell.out

    # Slurm's own ping finds the node gone (SlurmdTimeout) and schedules nothing there.
    assert wait_for(lambda: "*" in slurm.states().get(node_name(dead), ""), timeout=60), (
        slurm.states()
    )
    cell(f"%monarch scale 3 --wait {WAIT}")
    assert cell.out.splitlines() == [
        "monarch-nb: still 3 ranks; rank 1 lost its worker and got a new one with an empty "
        "namespace; the gloo process group was formed again over 3 ranks"
    ]
    again = _placement(cell, slurm, network)
    assert again[0] == placed[0] and again[2] == placed[2], (placed, again)
    assert again[1][1] != placed[1][1], again  # a new job
    assert again[1][0] in {placed[0][0], placed[2][0]}, again  # on a node left
    assert cell(ALL_REDUCE).values() == [(3, 6.0)] * 3
    cell("%monarch scale 2")
    assert cell.out.splitlines() == [
        "monarch-nb: scaled to 2 ranks; rank 2 left (its namespace went with it); "
        "the gloo process group was formed again over 2 ranks"
    ]
    cell(f"%monarch scale 3 --wait {WAIT}")
    assert cell(ALL_REDUCE).values() == [(3, 6.0)] * 3


def test_a_node_cut_off_mid_cell_is_named_in_time(slurm, site, cell):
    """The link to a node that runs one rank goes down while a cell runs there: the cell ends
    with that rank's WorkerLost within the promise of docs/scaling-out.md (its data
    connection's keep-alive probes unanswered: dispatch/links.py), the other ranks' values kept."""
    network = slurm.network
    placed = _placement(cell, slurm, network)
    nodes = [node for node, _ in placed]
    rank = next(r for r, node in enumerate(nodes) if nodes.count(node) == 1)
    role = _roles(placed)[rank]
    cut_at: list[float] = []

    def cut():
        cut_at.append(time.monotonic())
        network.link(role, "down")

    timer = threading.Timer(1.5, cut)
    timer.start()
    try:
        cell(_busy(rank), expect_error=True)
    finally:
        timer.cancel()
    took = time.monotonic() - cut_at[0]
    print(f"rank {rank} on {node_name(role)} named {took:.1f} s after its link was cut")
    assert took < LOST_HOST, f"the cell took {took:.1f} s after the cut"
    err = cell.error
    assert isinstance(err, monarch_nb.CellError), repr(err)
    assert list(err.errors) == [rank] and err.errors[rank].ename == "WorkerLost"
    assert (  # and the worker may live on behind it: restart is the way back
        "the worker is out of reach: its connection timed out: its host no longer answers (if "
        "the host comes back with it, %monarch restart gives every rank a fresh worker"
    ) in err.errors[rank].evalue
    assert err.errors[rank].host == network.address(role)
    assert err.results.to_dict() == {r: r for r in range(3) if r != rank}
    assert re.search(rf"^\[rank {rank}\] WorkerLost: on {network.address(role)}: ", cell.out, re.M)


def _roles(placed: list[tuple[str, str]]) -> list[str]:
    """Each rank's host role (``n0``...) from its node name."""
    by_node = {node_name(role): role for role in NODES}
    return [by_node[node] for node, _ in placed]
