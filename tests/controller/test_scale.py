"""``%monarch scale N`` and ``Controller.scale``: growing and shrinking a real cluster of worker
processes, through a real IPython shell."""

from __future__ import annotations

import _thread
import logging
import re
import threading
import time

import _actor_helpers as helpers
import cloudpickle
import dask
import psutil
import pytest
from _wait import running, wait_for
from distributed import LocalCluster
from IPython.core.error import UsageError

import monarch_nb
from monarch_nb import errors, registry
from monarch_nb.actors import mesh as actors
from monarch_nb.controller import attach, capacity
from monarch_nb.controller import cluster as clusters
from monarch_nb.controller import scale as scaling
from monarch_nb.dispatch.links import RankInfo
from monarch_nb.telemetry.store import Store

cloudpickle.register_pickle_by_value(helpers)

ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "(int(t.item()), dist.get_world_size(), world_size, 'kept' in dir())"
)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _pids(ctl) -> dict[int, int]:
    return dict(ctl.run("import os; os.getpid()").items())


def test_grow_to_4_and_shrink_to_2(no_current, cell):
    cell("%monarch up --workers 2 --cpu")
    ctl = errors.current()
    started = registry.get_entry(ctl.id)["started"]
    cell("%%monarch\nkept = rank * 10")

    cell("%monarch scale 4")
    assert cell.out.splitlines() == [
        "monarch-nb: scaled to 4 ranks; ranks 2-3 joined with empty namespaces "
        "(%monarch push NAME --targets 2:4 fills them); the gloo process group was formed "
        "again over 4 ranks"
    ]
    mesh = ctl.run(ALL_REDUCE)
    assert mesh.values() == [(4, 4, 4, True), (4, 4, 4, True), (4, 4, 4, False), (4, 4, 4, False)]
    assert ctl.pull("kept", targets=[0, 1]).values() == [0, 10]
    assert [i.local_rank for i in ctl.ranks] == [0, 1, 2, 3]
    assert actors.proc_mesh(ctl).extent == {"hosts": 1, "gpus": 4}
    entry = registry.get_entry(ctl.id)
    assert entry["ranks"] == 4 and entry["started"] == started  # the sidebar's count

    # Work still running on the leaving ranks (actor calls, sync and async) ends as it would.
    procs = actors.proc_mesh(ctl)
    counters = procs.spawn("counters", helpers.Counter)
    sleepers = procs.spawn("sleepers", helpers.Sleeper)
    slow = counters.slice(gpus=3).sleep.call_one(3)
    nap = sleepers.slice(gpus=2).nap.call_one(3, "nap")
    counters.slice(gpus=3).sleep.broadcast(6)  # no reply: only rank 3 knows it runs
    ctl.run("import monarch_nb\nmonarch_nb.log(step=0, loss=rank)")
    ctl.metrics.catch_up()
    leaving = [pid for rank, pid in _pids(ctl).items() if rank >= 2]

    cell("%monarch scale 2")
    assert cell.out.splitlines() == [
        "[rank 3] waiting for the running calls of actor 'counters' to end before leaving "
        "(interrupt to stop waiting: nothing is scaled then)",
        "monarch-nb: scaled to 2 ranks; ranks 2-3 left (their namespaces went with them); "
        "the gloo process group was formed again over 2 ranks",
    ]
    assert cell.err.splitlines() == [
        "monarch-nb: waiting for 2 actor calls on ranks 2-3 to end (interrupt to stop "
        "waiting: nothing is scaled then)"
    ]
    assert slow.get(timeout=10) == 3
    assert nap.get(timeout=10) == "nap"
    assert ctl.run(ALL_REDUCE).values() == [(2, 2, 2, True), (2, 2, 2, True)]
    assert ctl.pull("kept").values() == [0, 10]
    assert wait_for(lambda: not running(leaving), timeout=30)
    assert len(clusters.workers(ctl.client)) == 2
    assert actors.proc_mesh(ctl).extent == {"hosts": 1, "gpus": 2}
    assert registry.get_entry(ctl.id)["ranks"] == 2
    # Telemetry of the ranks that left stops showing (the panel, the sidebar's route); what
    # they logged stays in history().
    shown = {r["rank"] for r in ctl.metrics.snapshot()["ranks"]}
    assert shown <= {0, 1}
    assert {r["rank"] for r in ctl.metrics.scheduler_snapshot()["ranks"]} <= {0, 1}
    assert set(monarch_nb.history()) == {0, 1, 2, 3}
    time.sleep(1.5)  # what the ranks that stay send is still shown
    assert {r["rank"] for r in ctl.metrics.snapshot()["ranks"]} == {0, 1}

    cell("%monarch scale 2")
    assert cell.out.strip() == "monarch-nb: already 2 ranks; nothing changed"
    cell("%monarch down")


def test_refused_in_one_line(clean, cell):
    for line, words in [
        ("%monarch scale 0", "scale needs at least 1 rank, got 0; %monarch down stops the cluster"),
        ("%monarch scale -2", "scale needs at least 1 rank, got -2"),
    ]:
        cell(line, expect_error=True)
        assert isinstance(cell.error, UsageError)
        assert words in str(cell.error) and "\n" not in str(cell.error)
    cell("%monarch scale two", expect_error=True)
    assert "invalid int value: 'two'" in str(cell.error)
    with pytest.raises(TypeError, match=r"scale takes a whole number of ranks, got 2\.5"):
        clean.scale(2.5)

    handle = cell("%%monarch --noblock\nimport time; time.sleep(3)")
    cell("%monarch scale 3", expect_error=True)
    assert str(cell.error) == (
        "a %%monarch cell is running on ranks 0-1; scale once it has ended "
        "(handle.wait() waits for a --noblock one, %monarch interrupt stops it)"
    )
    handle.wait()
    assert clean.world_size == 2


def test_a_size_the_machine_cannot_hold_is_refused_before_anything_starts(clean, cell):
    # 10000 started a nanny per rank until the kernel ran out of descriptors; the other hung
    # planning its workers. Both are refused with the estimate, and nothing starts.
    specs = dict(clean.cluster.worker_spec)
    for n in (10000, 99999999999999999999):
        cell(f"%monarch scale {n}", expect_error=True)
        message = str(cell.error)
        assert isinstance(cell.error, UsageError) and "\n" not in message
        assert re.fullmatch(
            rf"scale {n} is more than this machine can hold: {n - 2} new ranks need about "
            r"[^;]+ \([^)]*each\), and [^;]+; scale to \d+ at most",
            message,
        ), message
        assert dict(clean.cluster.worker_spec) == specs and clean.world_size == 2
    # Any cluster (dask-jobqueue's has no maximum of its own): the links need open files here.
    with pytest.raises(ValueError, match=r"open files in this kernel \(6 each\), and \d+ of its"):
        capacity.check(1, 10**20, local=False)
    assert clean.run("rank").values() == [0, 1]


def test_up_of_more_ranks_than_the_machine_holds_is_refused_before_anything_starts(
    no_current, cell
):
    children = len(psutil.Process().children(recursive=True))
    for n in (10000, 99999999999999999999):
        cell(f"%monarch up --workers {n} --cpu", expect_error=True)
        message = str(cell.error)
        assert isinstance(cell.error, UsageError) and "\n" not in message
        assert re.fullmatch(
            rf"up --workers {n} is more than this machine can hold: {n} new ranks need about "
            r"[^;]+ \(\d+( \w+)? each\), and [^;]+; --workers \d+ at most",
            message,
        ), message
        assert errors.current() is None
    # nothing was started (the forkserver %load_ext starts is not a rank's)
    assert len(psutil.Process().children(recursive=True)) <= children + 1


class _Logged(logging.Handler):
    """The errors Dask, tornado and asyncio log (they reached the cell: 2.7 MB of them)."""

    NAMES = ("distributed.nanny", "distributed.deploy.spec", "tornado.application", "asyncio")

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_after_a_failed_grow_and_a_shrink_on_a_busy_loop_every_command_answers(no_current, cell):
    before = _children()
    cell("%monarch up --workers 2 --cpu")
    ctl = errors.current()
    # A real nanny that fails: each new worker imports a preload module that is not there.
    with _Logged() as logged, dask.config.set({"distributed.worker.preload": ["no_such_xyz"]}):
        cell("%monarch scale 4 --wait 20", expect_error=True)
    assert re.fullmatch(
        r"(a new worker|2 new workers) failed to start \(ModuleNotFoundError: No module named "
        r"'no_such_xyz'\); the cluster was scaled back to 2",
        str(cell.error),
    ), str(cell.error)
    assert [r.getMessage() for r in logged.records] == []
    assert cell.err.splitlines() == [f"UsageError: {cell.error}"]  # one line, no traceback
    assert list(ctl.cluster.worker_spec) == [0, 1] and list(ctl.cluster.workers) == [0, 1]
    assert len(clusters.workers(ctl.client)) == 2
    cell("%monarch status")
    assert [row.split()[-2] for row in cell.out.splitlines()[1:]] == ["idle", "idle"]
    assert cell("%%monarch\nrank").values() == [0, 1]

    # Rank 1 leaves while the event loop is held up (as a kernel out of descriptors held it):
    # its links cannot close in time. That raised TimeoutError with the rank half gone, and
    # every later command KeyError: 1.
    ctl._loop.call_soon_threadsafe(time.sleep, scaling.CLOSE_WAIT + 1)
    cell("%monarch scale 1")
    assert cell.out.startswith("monarch-nb: scaled to 1 rank; rank 1 left")
    assert cell("%%monarch\nrank").values() == [0]
    cell("%monarch status")
    assert len(cell.out.splitlines()) == 2
    cell("%monarch interrupt")
    assert cell.out == "monarch-nb: rank 0 was running nothing\n"
    cell("%monarch scale 2")
    assert cell("%%monarch\nrank").values() == [0, 1]
    cell("%monarch down")
    assert cell.out == "monarch-nb: cluster shut down\n"
    assert wait_for(lambda: not running(_children() - before), timeout=30)


def test_a_factory_cluster_grows_and_shrinks(no_current, cell, tmp_path):
    cell("%monarch connect --cluster _factories:one_worker")
    ctl = errors.current()
    (tmp_path / "scaled_helper.py").write_text("ANSWER = 42\n")
    ctl.sync(str(tmp_path / "scaled_helper.py"))
    cell("%monarch scale 2 --wait 0.01", expect_error=True)
    assert str(cell.error) == (
        "only 0 of 1 new workers joined within 0.01 s; the cluster was scaled back to 1 "
        "(wait=S waits longer)"
    )
    assert len(ctl.cluster.worker_spec) == 1 and ctl.world_size == 1
    assert wait_for(lambda: len(clusters.workers(ctl.client)) == 1)
    done = ctl.scale(2)
    assert (done.joined, done.left, done.backend) == ((1,), (), "gloo")
    assert ctl.run(ALL_REDUCE).values() == [(2, 2, 2, False), (2, 2, 2, False)]
    assert len(ctl.cluster.worker_spec) == 2
    # the new rank got what %monarch sync sent before it joined
    assert ctl.run("import scaled_helper; scaled_helper.ANSWER").values() == [42, 42]
    # Ctrl-C while a leaving rank's actor call runs: nothing is scaled, the call goes on.
    sleepers = actors.proc_mesh(ctl).spawn("sleepers", helpers.Counter)
    slow = sleepers.slice(gpus=1).sleep.call_one(4)
    threading.Timer(1.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt, match="stopped waiting for the work of rank 1 to end"):
        ctl.scale(1)
    assert ctl.world_size == 2 and slow.get(timeout=10) == 1
    done = ctl.scale(1)
    assert (done.joined, done.left) == ((), (1,))
    assert ctl.run(ALL_REDUCE).values() == [(1, 1, 1, False)]
    assert len(ctl.cluster.worker_spec) == 1
    cell("%monarch down")


def test_a_rank_whose_worker_is_gone_for_good_can_leave(no_current):
    ctl = monarch_nb.connect(cluster="_factories:one_worker")
    try:
        ctl.scale(2)
        ctl.cluster.sync(ctl.cluster.workers[1].close)  # nanny and worker: nothing restarts it
        assert wait_for(lambda: not ctl.ranks[1].alive, timeout=30)
        assert ctl.scale(1).left == (1,)
        assert wait_for(lambda: "monarch-replace-1" not in _threads(), timeout=5)
        # The new worker takes the name 1 again: it is a new rank, not rank 1's replacement.
        assert ctl.scale(2).joined == (1,)
        assert ctl.run("rank").values() == [0, 1]
        time.sleep(1)  # a replacement still looked for would have been taken by now
        assert [n for n in ctl.notices() if "replace" in n or "took its place" in n] == []
    finally:
        ctl.down()


def test_debug_of_a_rank_that_left_says_so(no_current, cell):
    cell("%monarch up --workers 2 --cpu")
    cell("%%monarch\nif rank == 1:\n    1 / 0", expect_error=True)
    cell("%monarch scale 1")
    assert cell.out == (
        "monarch-nb: scaled to 1 rank; rank 1 left (its namespace went with it); the gloo "
        "process group was formed again over 1 rank\n"
    )
    cell("%monarch debug --rank 1", expect_error=True)
    assert str(cell.error) == (
        "rank 1 left with %monarch scale since that cell failed, and its traceback went with "
        "it (the world is 1 now)"
    )
    cell("%monarch scale 2")
    assert cell.out == (
        "monarch-nb: scaled to 2 ranks; rank 1 joined with an empty namespace (%monarch push "
        "NAME --targets 1:2 fills it); the gloo process group was formed again over 2 ranks\n"
    )
    cell("%monarch debug --rank 1", expect_error=True)
    assert str(cell.error) == (
        "rank 1 was restarted since that cell failed (or left with %monarch scale and a new "
        "worker joined as it), and its traceback went with the old worker"
    )
    cell("%monarch down")


def test_a_cluster_that_cannot_scale_is_refused(no_current, cell):
    with LocalCluster(
        n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        cell(f"%monarch connect {cluster.scheduler_address}")
        cell("%monarch scale 2", expect_error=True)
        assert str(cell.error) == (
            f"this notebook joined the scheduler at {cluster.scheduler_address}, which cannot "
            "add or remove workers; scale the workers where they were started, or connect "
            "with --cluster module:factory to a cluster object that has scale()"
        )
        cell("%monarch down")
        assert len(cluster.scheduler_info["workers"]) == 1
    cell("%monarch connect --cluster _factories:unscalable")
    cell("%monarch scale 2", expect_error=True)
    assert str(cell.error).startswith("the cluster (Unscalable) has no scale()")
    cell("%monarch down")


def test_ranks_before_keep_their_numbers_and_new_workers_follow():
    def worker(name, host="h"):
        return {"name": name, "host": host, "local_directory": f"/tmp/{name}"}

    before = [RankInfo(0, "b", "tcp://h:2", "h"), RankInfo(1, "a", "tcp://h:1", "h")]
    workers = {
        "tcp://h:1": worker("a"),
        "tcp://h:2": worker("b"),
        "tcp://g:9": worker("c", "g"),
        "tcp://h:3": worker("d"),
    }
    table = attach.rank_table(workers, previous=before)
    assert [(i.rank, i.name, i.local_rank) for i in table] == [
        (0, "b", 0),
        (1, "a", 1),
        (2, "c", 0),  # the new ones by host, then address
        (3, "d", 2),
    ]


def test_a_retired_ranks_late_batch_is_dropped_and_a_new_worker_is_shown():
    store = Store()
    store.add({"rank": 3, "rec": "old", "scalars": [(0, 1.0, {"loss": 1.0})], "samples": []})
    store.retire([3])
    assert store.snapshot()["ranks"] == []
    store.add({"rank": 3, "rec": "old", "scalars": [(1, 2.0, {"loss": 2.0})], "samples": []})
    assert store.snapshot()["ranks"] == []  # the old worker's last flush, after it left
    assert [len(rs.scalars) for rs in store.sorted(retired=True)] == [1]
    store.add({"rank": 3, "rec": "new", "scalars": [(0, 3.0, {"loss": 3.0})], "samples": []})
    assert [r["rank"] for r in store.snapshot()["ranks"]] == [3]


def test_new_local_ranks_get_the_next_gpus(no_current, monkeypatch):
    # A stand-in for three GPUs this machine lacks: the pinning is what is checked.
    gpus = clusters.GpuInventory("cuda", ("5", "6", "7"), "CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(clusters, "detect_gpus", lambda: gpus)
    ctl = monarch_nb.up(workers=2)
    try:
        assert ctl.scale(3).joined == (2,)
        pinned = ctl.run("import os; os.environ['CUDA_VISIBLE_DEVICES']").values()
        assert pinned == ["5", "6", "7"]
        with pytest.raises(ValueError, match="4 ranks need 4 GPUs, one each, but 3 are visible"):
            ctl.scale(4)
        assert ctl.world_size == 3 and len(ctl.cluster.worker_spec) == 3
    finally:
        ctl.down()
