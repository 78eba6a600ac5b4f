"""Descriptors and processes on the ranks, and concurrency in the notebook: forked children's
output, long lines written to fds 1 and 2, up and down racing each other or a scheduler that
went first, an up cut short by a real signal."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import threading
import time

import pytest
from _wait import running, wait_for

import monarch_nb
from monarch_nb import ClusterError
from monarch_nb import errors as module


def _mine(out: str, rank: int) -> list[str]:
    tag = f"[rank {rank}] "
    return [ln[len(tag) :] for ln in out.splitlines() if ln.startswith(tag)]


# -- forked children ------------------------------------------------------------------------------
FORKS = """
import multiprocessing as mp, os, sys
def job(x):
    print('pool', x)
    return x
pid = os.fork()
if pid == 0:
    print('os.fork child', rank)
    sys.stderr.write('os.fork child on stderr\\n')
    os._exit(0)
os.waitpid(pid, 0)
ctx = mp.get_context('fork')
p = ctx.Process(target=print, args=('fork Process', rank))
p.start(); p.join()
p = ctx.Process(target=sys.stdout.write, args=('half a line, ',))  # flushed as it exits
p.start(); p.join()
print('ended by the parent')
with ctx.Pool(1) as pool:
    pool.map(job, range(2))
print('parent', rank)
"""


def test_what_forked_children_print_reaches_the_cell_in_order(clean, capsys):
    clean.run(FORKS, collapse=False)
    captured = capsys.readouterr()
    for rank in (0, 1):
        assert _mine(captured.out, rank) == [
            f"os.fork child {rank}",
            f"fork Process {rank}",
            "half a line, ended by the parent",
            "pool 0",
            "pool 1",
            f"parent {rank}",
        ]
        assert _mine(captured.err, rank) == ["os.fork child on stderr"]


def test_a_forked_child_that_outlives_its_cell_prints_to_the_worker_log(clean, capsys):
    """A daemonized grandchild's later lines are not the next cell's; that cell is whole."""
    clean.run(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(0.5)\n"
        "        print('daemon, after its cell')\n"
        "    os._exit(0)\n"
        "print('started')",
        targets=0,
    )
    time.sleep(1.5)
    clean.run("print('next')", targets=0)
    out = capsys.readouterr().out
    assert _mine(out, 0) == ["started", "next"]


# -- long lines on the descriptors ---------------------------------------------------------------
LONG = """
import os, subprocess, sys
os.write(1, b'a' * 300_000 + b'\\n')
for _ in range(10):  # one line in pieces, as C's stdio writes a long one
    os.write(1, b'b' * 100_000)
os.write(1, b'\\n')
subprocess.run([sys.executable, '-c', "print('c' * 3_000_000)"])  # longer than the pipe
os.write(1, b'd' * 100_000)  # unfinished: the print after it does not wait for its end
print('end')
"""


def test_long_lines_written_to_the_descriptors_arrive_whole(clean, capsys):
    clean.run(LONG, targets=0)
    lines = _mine(capsys.readouterr().out, 0)
    assert [(line[:1], len(line)) for line in lines] == [
        ("a", 300_000),
        ("b", 1_000_000),
        ("c", 3_000_000),
        ("d", 100_000),
        ("e", 3),
    ]


# -- up and down ---------------------------------------------------------------------------------
def _workers() -> set[int]:
    """This process's live descendants, but multiprocessing's resource tracker and forkserver
    (it lives while any local cluster does: test_forkserver.py)."""
    import psutil

    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            # (a worker forked from the forkserver has its command line, not its parent)
            server = "multiprocessing.forkserver" in cmd and p.ppid() == os.getpid()
            if "resource_tracker" not in cmd and not server:
                pids.add(p.pid)
        except psutil.Error:  # gone, or a zombie
            pass
    return pids


def test_two_ups_at_once_make_one_cluster(no_current):
    before = _workers()
    barrier = threading.Barrier(2)
    made, refused = [], []

    def up():
        barrier.wait()
        try:
            made.append(monarch_nb.up(workers=1, cpu=True, dist=False))
        except ClusterError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=up) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1, refused
    assert refused == [
        "another %monarch up or connect is under way in this kernel; "
        "wait for it to finish (then %monarch down first to start another)"
    ]
    assert module.current() is made[0]
    made[0].down()
    assert wait_for(lambda: not running(_workers() - before), timeout=20)


def test_an_up_interrupted_by_a_signal_has_stopped_its_cluster_when_it_returns(
    no_current, monkeypatch
):
    """A real SIGINT (Jupyter's stop button), not _thread.interrupt_main: a Thread.join that a
    signal interrupts returns at once the next time (Python < 3.13), so the interrupted up
    returned while its cluster went on starting; closed later, under the next up, it put
    Dask's log handler back to showing INFO lines."""
    from distributed.deploy.spec import SpecCluster

    before = set(SpecCluster._instances)  # the shared cluster of other tests
    handler = logging.StreamHandler(io.StringIO())  # Dask's own, as outside pytest
    monkeypatch.setattr(logging.getLogger("distributed"), "handlers", [handler])
    # spawned workers: forked from a forkserver that runs already, a worker may be up in 0.5 s
    monkeypatch.setenv("MONARCH_NB_FORKSERVER", "0")
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt, match="up interrupted; its workers were stopped"):
        monarch_nb.up(workers=1, cpu=True, dist=False)
        time.sleep(30)  # up finished first: the interrupt lands here, without that message
    assert [c.status.name for c in set(SpecCluster._instances) - before] in ([], ["closed"])
    assert wait_for(lambda: "monarch-up" not in [t.name for t in threading.enumerate()], 2)
    assert handler.level == logging.NOTSET  # silence_logs let go of it


def test_down_after_the_scheduler_went_is_quick_and_quiet(no_current):
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    ctl.cluster.sync(ctl.cluster.scheduler.close)  # what the sidebar's "Shut down" does
    assert wait_for(lambda: ctl.client.status != "running", timeout=10)
    with pytest.raises(ClusterError, match="is gone"):
        ctl.run("1")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    loggers = [logging.getLogger(n) for n in ("distributed.client", "distributed.nanny")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        start = time.monotonic()
        ctl.down()
        took = time.monotonic() - start
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert took < 5, took  # 30 s and more: Dask tried to reach the scheduler to shut it down
    assert [r.getMessage() for r in seen if r.levelno >= logging.WARNING] == []
    assert module.current() is None


def test_down_does_not_show_the_nanny_killing_a_worker_slow_to_exit(no_current):
    """The nanny kills a worker still busy 4 s after down asked it to close: what down asked
    for, not a warning for the notebook."""
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
    # an exit handler holds the worker's exit, as a busy worker on a loaded machine does
    ctl.run("import atexit, time\natexit.register(time.sleep, 60)")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    nanny = logging.getLogger("distributed.nanny")
    nanny.addHandler(handler)
    try:
        ctl.down()
    finally:
        nanny.removeHandler(handler)
    assert [r.getMessage() for r in seen if r.levelno >= logging.WARNING] == []


def _hold_heartbeats(ctl) -> list[str]:
    """The in-kernel scheduler answers the workers' heartbeats only after 30 s, as one that
    many workers keep busy on a loaded machine answers them late: each worker soon has one on
    its way. Returns the workers whose heartbeat waits."""
    scheduler = ctl.cluster.scheduler
    answer = scheduler.handlers["heartbeat_worker"]
    waiting: list[str] = []

    async def late(**kwargs):
        waiting.append(kwargs["address"])
        await asyncio.sleep(30)
        return answer(**kwargs)

    scheduler.handlers["heartbeat_worker"] = late
    return waiting


def _dask_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "distributed." in ln or "Traceback" in ln]


def test_down_shows_nothing_of_workers_closed_with_a_heartbeat_on_its_way(no_current, capfd):
    """A closing worker closes its connections, and its heartbeat waiting on the scheduler
    fails: Dask logged that with two tracebacks on the kernel's stderr (the workers' own)."""
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    waiting = _hold_heartbeats(ctl)
    assert wait_for(lambda: len(set(waiting)) == 2, timeout=15)
    capfd.readouterr()
    ctl.down()  # returns once the nannies have joined their workers
    assert _dask_lines(capfd.readouterr().err) == []


def test_workers_show_nothing_when_their_scheduler_goes_first(no_current, capfd):
    """The sidebar's "Shut down" with heartbeats on their way: each worker's fails before it
    hears why; the controller says the scheduler is gone, in one line, and down is quiet."""
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    pids = ctl.run("import os\nos.getpid()").values()
    waiting = _hold_heartbeats(ctl)
    assert wait_for(lambda: len(set(waiting)) == 2, timeout=15)
    capfd.readouterr()
    ctl.cluster.sync(ctl.cluster.scheduler.close)
    assert wait_for(lambda: ctl.client.status != "running", timeout=10)
    time.sleep(0.5)  # what the workers print as they learn of it
    ctl.down()
    assert wait_for(lambda: not running(pids), timeout=10)
    assert _dask_lines(capfd.readouterr().err) == []
