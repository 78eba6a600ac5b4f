"""Kept clusters (``up(keep=...)``) driven from this process as a notebook would: detached and
attached again with every rank's state (namespace, process group, device mesh, actors), a
second controller refused and ``take``, scaling, the idle limit, TLS, a runtime directory
cleaned under it, and ``down``; a name asked for by two processes at once, and idle limits past
the maximum. A kernel restart and SIGKILL are in tests/notebook/test_keep_kernels.py."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys

import _actor_helpers as helpers
import cloudpickle
import psutil
import pytest
from _wait import running, wait_for

import monarch_nb
from monarch_nb import errors, kept, registry
from monarch_nb.actors import mesh as actors
from monarch_nb.actors import recover
from monarch_nb.controller import hosting
from monarch_nb.errors import ClusterError

cloudpickle.register_pickle_by_value(helpers)
NAME = "kept-test"


@pytest.fixture(scope="module")
def held(runtime):
    """A kept 2-rank cluster with a dp=2 mesh; ``held["ctl"]`` is whichever controller holds it
    now (the tests hand it on)."""
    ctl = monarch_nb.up(workers=2, cpu=True, keep="10m", name=NAME, mesh="dp=2", current=False)
    box = {"ctl": ctl, "host": ctl.kept["pid"]}
    yield box
    if not box["ctl"].closed:
        box["ctl"].down()
    kept.stop_host(ctl.kept)  # left detached by a test that failed


def cluster_processes(host: int) -> list[int]:
    """The host and every process it started: its forkserver, the workers, their keepers."""
    return [host, *(p.pid for p in psutil.Process(host).children(recursive=True))]


@pytest.fixture
def current_is(shell):
    """``current_is(ctl)``: the magics drive ``ctl`` for the test; the current one is put back."""
    saved = errors.current()
    yield errors.set_current
    errors.set_current(saved)


def test_a_detached_cluster_is_attached_again_with_every_ranks_state(held, cell, current_is):
    ctl = held["ctl"]
    assert ctl.kept["name"] == NAME and ctl.dist_backend == "gloo"
    ctl.run("x = rank * 10\nimport torch.distributed as dist\nworld = dist.group.WORLD\nm0 = mesh")
    counters = actors.proc_mesh(ctl).spawn("counters", helpers.Counter, 5)
    assert counters.incr.call(1).get(timeout=30).values() == [6, 6]
    processes = cluster_processes(held["host"])
    assert len(processes) >= 3  # the host, its forkserver, two workers (and their keepers)

    ctl.detach()
    assert ctl.closed and kept.find(NAME)["holder"] is None
    with pytest.raises(ClusterError, match=r"^detached: .* its actors live on: %monarch attach"):
        counters.incr.call(1)

    again = held["ctl"] = monarch_nb.attach(NAME, current=False)
    assert again.pull("x").values() == [0, 10]
    # the same group and mesh objects: what a model was wrapped or sharded with still works
    assert again.run("world is dist.group.WORLD and m0 is mesh").values() == [True, True]
    assert again.run("dist.all_reduce(t := __import__('torch').ones(1)); t.item()").values() == [
        2.0,
        2.0,
    ]
    assert (again.dist_backend, again.mesh_shape) == ("gloo", {"dp": 2})
    (live,) = recover.live_meshes(again)
    assert (live.name, live.info[0], live.held, sorted(live.points)) == (
        "counters",
        "Counter",
        "no one",
        [0, 1],
    )
    handle = monarch_nb.actor_mesh("counters", again)
    assert handle.incr.call(1).get(timeout=30).values() == [7, 7]  # the same actors, counting
    assert recover.live_meshes(again)[0].held == "this notebook"
    again.push({"y": 3})
    assert again.pull("y").values() == [3, 3]
    assert len(again.stacks().ranks) == 2
    assert again.id in {e["id"] for e in registry.list_entries()}  # the sidebar lists it
    assert running(processes) == processes  # nothing was restarted
    # it listens where a local cluster does: loopback only (scheduler, dashboard, nannies in
    # the host; workers, engines, the process group's store and pairs on the ranks)
    pids = [held["host"], *(row["pid"] for row in again.status())]
    for pid in pids:
        ips = {c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if not c.raddr}
        assert ips and all(ipaddress.ip_address(ip).is_loopback for ip in ips), (pid, ips)
    with pytest.raises(ValueError, match=r"no live actor mesh is named 'nope' .*there: counters"):
        monarch_nb.actor_mesh("nope", again)
    current_is(again)  # the magics: %monarch actors, and a cell with its live panel
    cell("%monarch actors")
    row = ["counters", "Counter", "2", "ranks", "0-1", "this", "notebook"]
    assert cell.out.splitlines()[1].split() == row
    assert cell("%%monarch\nimport time; time.sleep(1.5)\nx + y").values() == [3, 13]


def test_a_second_controller_is_refused_and_take_detaches_the_first(held):
    first = held["ctl"]
    with pytest.raises(ClusterError) as refused:
        monarch_nb.attach(NAME, current=False)
    holder = f"process {os.getpid()} (not a Jupyter kernel)"  # in a kernel, its id (and notebook)
    assert str(refused.value).startswith(f"kept cluster {NAME} is attached to {holder}; ")
    assert str(refused.value).endswith(
        f"%monarch attach {NAME} --take detaches it there and attaches here"
    )
    assert first.pull("x").values() == [0, 10]  # left as it was

    second = held["ctl"] = monarch_nb.attach(NAME, take=True, current=False)
    assert wait_for(lambda: first.closed, timeout=60)
    with pytest.raises(
        ClusterError, match=rf"took kept cluster {NAME} over \(%monarch attach --take\)"
    ):
        first.run("1")
    assert second.pull("x").values() == [0, 10]


def test_a_kept_cluster_scales_through_its_host(held):
    ctl = held["ctl"]
    done = ctl.scale(4)
    assert done.joined == (2, 3) and ctl.mesh_shape == {"dp": 4}
    assert kept.find(NAME)["ranks"] == 4
    ctl.scale(2)
    assert ctl.pull("x").values() == [0, 10] and kept.find(NAME)["ranks"] == 2


def test_mistakes_are_one_line_and_start_nothing(held, runtime):
    before = kept.entries()
    for kwargs, message in [
        ({"keep": "soon"}, "--keep takes an idle limit such as 90s, 30m, 2h or 1d"),
        ({"keep": 0}, "the idle limit must be more than 0 seconds"),
        ({"name": "x"}, "--name names a kept cluster: add --keep"),
        ({"keep": True, "name": NAME}, f"a kept cluster named {NAME} is running"),
        ({"keep": True, "name": "../x"}, "--name '../x': use up to 64 letters"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            monarch_nb.up(workers=1, cpu=True, current=False, **kwargs)
    with pytest.raises(
        ClusterError, match=rf"no kept cluster is named nope \(running here: {NAME}\)"
    ):
        monarch_nb.attach("nope", current=False)
    assert kept.entries() == before
    # a file of the user's own naming the cluster's host but not its token: the host refuses
    forged = {**before[0], "id": "f" * 32, "name": "forged", "token": "0" * 32}
    kept.write(forged)
    with pytest.raises(ClusterError, match="refused this kernel: the token is not this cluster's"):
        monarch_nb.attach("forged", current=False)
    kept.remove(forged["id"])


def test_a_cluster_started_without_keep_refuses_to_detach(clean):
    with pytest.raises(ClusterError, match="runs inside this kernel and goes with it"):
        clean.detach()
    assert not clean.closed and clean.run("rank").values() == [0, 1]


def test_a_detached_tls_cluster_shuts_itself_down_after_its_idle_limit(held, runtime):
    ctl = monarch_nb.up(
        workers=1, cpu=True, keep=3, name="idle", tls=True, dist=False, current=False
    )
    assert ctl.kept["tls"] is not None and ctl.scheduler_address.startswith("tls://")
    ctl.run("z = 42")
    ctl.detach()
    with pytest.raises(ClusterError, match=rf"2 kept clusters are running \({NAME}, idle\): name"):
        monarch_nb.attach(current=False)
    again = monarch_nb.attach("idle", current=False)  # with the certificate from its file
    assert again.pull("z").values() == [42]
    processes = cluster_processes(again.kept["pid"])
    again.detach()
    assert wait_for(lambda: not running(processes), timeout=120), running(processes)
    log = kept.log_path(again.kept["id"]).read_text()
    assert log.rstrip().endswith("shut down: no kernel held it for its idle limit of 3 s"), log
    assert [e["name"] for e in kept.entries()] == [NAME]


def name_is_free(name: str) -> bool:
    """Whether nothing holds ``name`` now (a claim that succeeds is let go of at once)."""
    fd = kept.claim_name(name)
    if fd is not None:
        kept.release_name(fd, name)
    return fd is not None


def test_a_runtime_directory_cleaned_under_a_kept_cluster_is_written_again(held):
    """Its file and its name's lock, deleted (by hand, or a runtime directory cleaned at
    logout) while it runs: the host writes them again, and the cluster is attached by name."""
    held["ctl"].detach()
    shutil.rmtree(kept.kept_dir())
    assert wait_for(lambda: kept.find(NAME) is not None and not name_is_free(NAME), timeout=60)
    again = held["ctl"] = monarch_nb.attach(NAME, current=False)
    assert again.pull("x").values() == [0, 10]


def test_down_shuts_the_host_and_every_process_down(held):
    ctl = held["ctl"]
    processes = cluster_processes(held["host"])
    entry_id = ctl.kept["id"]
    ctl.down()
    assert wait_for(lambda: not running(processes), timeout=60), running(processes)
    assert kept.entries() == [] and not (kept.kept_dir() / f"{entry_id}.json").exists()
    assert not kept.log_path(entry_id).exists()  # asked for: nothing to read later
    assert not (kept.kept_dir() / f"{NAME}.lock").exists() and name_is_free(NAME)


def test_an_idle_limit_past_30_days_is_refused_in_one_line(runtime, cell, current_is):
    current_is(None)
    logs = set(kept.kept_dir().glob("*.log"))
    cell("%monarch up --keep 99999999999999999999999d --workers 1 --cpu", expect_error=True)
    assert str(cell.error) == (
        "--keep: the idle limit can be at most 30d (30 days without a kernel), "
        "got '99999999999999999999999d'"
    )
    for keep in ("31d", 30 * 86400 + 1, 10**400, float("inf")):
        with pytest.raises(ValueError, match=r"^--keep: the idle limit can be at most 30d "):
            monarch_nb.up(workers=1, cpu=True, keep=keep, current=False)
    assert set(kept.kept_dir().glob("*.log")) == logs  # no host was started


def test_a_name_claimed_by_a_host_starting_now_is_not_given_again(runtime, monkeypatch):
    """Held as a starting host holds it, before its file is written: ``--name`` is refused at
    once, and the name a notebook's cluster gets by default skips it."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)  # named "cluster", not a notebook's
    held = kept.claim_name("cluster")
    try:
        with pytest.raises(ValueError, match=r"^a kept cluster named cluster is running"):
            monarch_nb.up(workers=1, cpu=True, keep=True, name="cluster", current=False)
        name, fd = hosting.claim_name(None, set())
        kept.release_name(fd, name)
        assert name == "cluster-2"
    finally:
        kept.release_name(held, "cluster")


# Two kernels' `%monarch up --keep --name race`, let go at the same moment.
RACE = """
import json, sys
import monarch_nb
from monarch_nb.controller import start  # noqa: F401 (a kernel has imported it too)
print("ready", flush=True)
sys.stdin.readline()
try:
    ctl = monarch_nb.up(workers=1, cpu=True, keep="10m", name="race", dist=False, current=False)
except ValueError as e:
    print(json.dumps({"refused": str(e)}), flush=True)
else:
    ctl.run("x = 7")
    print(json.dumps({"host": ctl.kept["pid"]}), flush=True)
    ctl.detach()
"""


def test_two_processes_asking_for_one_name_at_once_start_one_cluster(runtime):
    logs = set(kept.kept_dir().glob("*.log"))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RACE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        assert [c.stdout.readline() for c in children] == ["ready\n"] * 2
        for c in children:
            c.stdin.write("go\n")
            c.stdin.flush()
        said = sorted((json.loads(c.stdout.readline()) for c in children), key=str)
        assert [c.wait(60) for c in children] == [0, 0]
        assert said[0].keys() == {"host"}, said
        assert said[1] == {
            "refused": "a kept cluster named race is running: %monarch attach race attaches to "
            "it, or give another --name"
        }
        assert len(set(kept.kept_dir().glob("*.log")) - logs) == 1  # the loser started nothing
        ctl = monarch_nb.attach("race", current=False)
        assert ctl.kept["pid"] == said[0]["host"] and ctl.pull("x").values() == [7]
        ctl.detach()
        # a host that dies holds its name no more: the lock goes with its last descriptor
        processes = cluster_processes(said[0]["host"])
        assert not name_is_free("race")
        os.kill(said[0]["host"], signal.SIGKILL)
        assert wait_for(lambda: not running(processes), timeout=60), running(processes)
        assert name_is_free("race") and kept.find("race") is None
    finally:
        for c in children:
            c.kill()
            c.wait()
        for entry in kept.entries():
            if entry["name"] == "race":
                kept.stop_host(entry)
