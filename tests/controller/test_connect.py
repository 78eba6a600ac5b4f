"""Joining clusters the controller did not start."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc

import pytest
from _peers import CLAIMS_4_GIB, GARBAGE, SSH_BANNER, HttpPeer, Peer
from distributed import LocalCluster

import monarch_nb
from monarch_nb import registry
from monarch_nb.controller import controller as module


@pytest.fixture(scope="module")
def local_cluster():
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        yield cluster


def test_connect_by_address_leaves_the_cluster_running(no_current, local_cluster):
    ctl = monarch_nb.connect(local_cluster.scheduler_address)
    assert ctl.run("rank").values() == [0, 1]
    # the sidebar learns that this notebook joined the cluster and must not shut it down
    assert registry.get_entry(ctl.id)["owns_cluster"] is False
    ctl.down()
    assert len(local_cluster.scheduler_info["workers"]) == 2


def test_connect_by_scheduler_file(no_current, tmp_path):
    path = tmp_path / "scheduler.json"
    with LocalCluster(
        n_workers=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=":0",
        scheduler_kwargs={"scheduler_file": str(path)},
    ):
        ctl = monarch_nb.connect(scheduler_file=str(path))
        assert ctl.run("world_size").values() == [1]
        ctl.down()


def test_connect_to_a_cluster_object_and_factory(no_current, local_cluster):
    ctl = monarch_nb.connect(cluster=local_cluster)
    assert ctl.world_size == 2
    ctl.down()
    assert len(local_cluster.scheduler_info["workers"]) == 2  # not ours: it keeps running
    ctl = monarch_nb.connect(cluster="_factories:one_worker")
    assert ctl.world_size == 1
    assert ctl.owns_cluster and registry.get_entry(ctl.id)["owns_cluster"] is True
    ctl.down()  # the factory made it for this controller: down closes it
    assert ctl.cluster.status.name == "closed"


def test_ranks_are_sorted_by_host_then_address():
    workers = {
        "tcp://10.0.0.2:900": {"name": "b", "host": "10.0.0.2"},
        "tcp://10.0.0.1:80": {"name": "c", "host": "10.0.0.1"},
        "tcp://10.0.0.1:70": {"name": "a", "host": "10.0.0.1"},
    }
    table = module.Controller.rank_table(workers)
    assert [(i.rank, i.name, i.local_rank) for i in table] == [
        (0, "a", 0),
        (1, "c", 1),
        (2, "b", 0),
    ]
    # After a restart the same names keep their ranks, whatever their new addresses.
    moved = {
        "tcp://10.0.0.1:1": {"name": "b", "host": "10.0.0.2"},
        "tcp://10.0.0.1:2": {"name": "a", "host": "10.0.0.1"},
        "tcp://10.0.0.1:3": {"name": "c", "host": "10.0.0.1"},
    }
    again = module.Controller.rank_table(moved, previous=table)
    assert [i.name for i in again] == ["a", "c", "b"]


def test_connect_to_nobody_fails_within_10_seconds(no_current):
    start = time.monotonic()
    with pytest.raises(monarch_nb.ClusterError, match="cannot reach a Dask scheduler"):
        monarch_nb.connect("tcp://127.0.0.1:9", timeout=3)
    assert time.monotonic() - start < 10


def test_connect_needs_exactly_one_target(no_current):
    with pytest.raises(monarch_nb.ClusterError, match="exactly one"):
        monarch_nb.connect()


FACTORY = """
from distributed import LocalCluster

made = []


def make():
    made.append(LocalCluster(n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0"))
    return made[-1]
"""


@pytest.fixture
def factory(tmp_path, monkeypatch):
    """``made_here:make``, a factory that keeps the clusters it made in ``made_here.made``."""
    (tmp_path / "made_here.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "made_here", raising=False)
    import made_here

    yield made_here
    for cluster in made_here.made:
        cluster.close()
    del sys.modules["made_here"]


def test_a_connect_that_fails_closes_the_cluster_its_factory_made(no_current, factory):
    start = time.monotonic()
    with pytest.raises(monarch_nb.ClusterError, match="only 1 of 2 workers joined within 1 s"):
        monarch_nb.connect(cluster="made_here:make", workers=2, wait=1, dist=False)
    assert time.monotonic() - start < 15  # --wait, not a fixed minute
    assert [c.status.name for c in factory.made] == ["closed"]


def test_wait_bounds_the_wait_for_workers_and_leaves_a_joined_cluster_up(
    no_current, local_cluster, capsys
):
    # Both of the cluster's workers registered first: what the message counts is then certain.
    deadline = time.monotonic() + 30
    while len(local_cluster.scheduler_info["workers"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(monarch_nb.ClusterError, match=r"only 2 of 3 workers joined within 2\.5 s"):
        monarch_nb.connect(local_cluster.scheduler_address, workers=3, wait=2.5, dist=False)
    assert time.monotonic() - start < 10
    assert "2 of 3 workers have joined; waiting up to 2.5 s" in capsys.readouterr().err
    assert len(local_cluster.scheduler_info["workers"]) == 2


def test_magic_down_closes_a_factory_cluster(no_current, factory, cell):
    cell("%monarch connect --cluster made_here:make --no-dist")
    assert "made_here:make made this cluster; %monarch down shuts it down" in cell.out
    cell("%monarch down")
    assert "cluster shut down" in cell.out
    assert [c.status.name for c in factory.made] == ["closed"]
    cell("%monarch connect --cluster made_here:make --workers 2 --wait 1", expect_error=True)
    assert "only 1 of 2 workers joined within 1 s" in str(cell.error)
    assert [c.status.name for c in factory.made] == ["closed", "closed"]


# -- what answers at an address may be no scheduler (issue 47) -----------------------------------
@pytest.mark.parametrize("kind", ["http", "silent"])
def test_connect_to_a_port_that_never_speaks_returns_within_its_timeout(no_current, cell, kind):
    # the dashboard's 8787 typed for the scheduler's 8786 held connect for as long as it stayed
    # open: Dask's Client bounds the connection, not the handshake after it
    peer = HttpPeer() if kind == "http" else Peer()
    start = time.monotonic()
    try:
        cell(f"%monarch connect {peer.address} --timeout 2", expect_error=True)
    finally:
        peer.close()
    assert time.monotonic() - start < 15
    assert (
        str(cell.error)
        == {
            "http": f"{peer.address} answered, but not as a Dask scheduler (it speaks HTTP: is it "
            "the dashboard? the scheduler is usually on 8786)",
            "silent": f"{peer.address} took the connection but sent no Dask handshake within 2 s "
            "(a scheduler stopped or too busy to answer, or no scheduler at all)",
        }[kind]
    )
    assert "Traceback" not in cell.out + cell.err


@pytest.mark.parametrize(
    "first, says",
    [
        (SSH_BANNER, "it is an SSH server: its first bytes (SSH-2.0-) claim a message of 2.82 EiB"),
        (CLAIMS_4_GIB, "its first bytes (00 00 00 00 01 00 00 00) claim a message of 4 GiB"),
        (GARBAGE, "its first bytes (ff fe 12 34 56 78 9a 7f) claim a message of 7.98 EiB"),
    ],
    ids=["ssh", "4-gib", "garbage"],
)
def test_a_peer_that_speaks_first_is_one_line_and_gets_none_of_what_it_claims(
    no_current, local_cluster, first, says
):
    # Dask's comm allocates what a peer's first 8 bytes claim: an SSH banner's 2.82 EiB was
    # refused by numpy for its size only, and a peer claiming 4 GiB got them
    peer = Peer(first)
    tracemalloc.start()
    try:
        with pytest.raises(monarch_nb.ClusterError) as caught:
            monarch_nb.connect(peer.address, timeout=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        peer.close()
    assert str(caught.value) == (
        f"{peer.address} answered, but not as a Dask scheduler ({says}; a handshake is 64 KiB "
        "at most)"
    )
    assert peak < 2**28, peak
    ctl = monarch_nb.connect(local_cluster.scheduler_address, dist=False)  # the kernel goes on
    assert ctl.world_size == 2
    ctl.down()


def test_connect_to_a_workers_address_says_whose_it_is(no_current, local_cluster):
    # it passed Dask's handshake, then the Client raised a TypeError from the worker's identity
    worker = next(iter(local_cluster.scheduler_info["workers"]))
    with pytest.raises(monarch_nb.ClusterError) as caught:
        monarch_nb.connect(worker, timeout=5)
    assert str(caught.value) == (
        f"{worker} answered, but not as a Dask scheduler (it is a Dask worker, of the scheduler "
        f"at {local_cluster.scheduler_address}: connect to its scheduler)"
    )


SCRIPT = """
import sys, time
import monarch_nb
from monarch_nb.controller import handshake

try:
    {call}
except Exception as e:
    print(type(e).__name__, flush=True)
print(time.monotonic(), flush=True)
"""


@pytest.mark.parametrize(
    "call, raises",
    [
        ("monarch_nb.connect(sys.argv[1], timeout=10)", "ClusterError"),
        # a Client that fails after the check, as a cluster object's (which is not checked)
        (
            "handshake.bound_dask_handshakes(); "
            "handshake.client(sys.argv[1], timeout=10, set_as_default=False)",
            "NotDask",
        ),
    ],
    ids=["connect", "client"],
)
def test_a_script_exits_at_once_after_a_connect_that_failed(tmp_path, call, raises):
    # a Client whose start failed was closed by its __del__ at exit, once Dask's event loop was
    # gone: it waited out twice its timeout there (20 s here)
    peer = Peer(SSH_BANNER)
    (tmp_path / "script.py").write_text(SCRIPT.format(call=call))
    try:
        done = subprocess.run(
            [sys.executable, str(tmp_path / "script.py"), peer.address],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        peer.close()
    exited = time.monotonic()
    said, when = done.stdout.split()
    assert exited - float(when) < 8, done.stderr
    assert said == raises, done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr
