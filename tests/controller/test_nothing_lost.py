"""Nothing lost, nothing leaked: a 4-rank cluster prints 100,000 lines that all arrive whole
and in order, and 1,000 consecutive cells leave memory, threads, descriptors and the metrics
store bounded. What threads a cell started print, and what subprocesses and C code write to
fds 1 and 2, arrive tagged; what Dask itself prints stays in the worker's own log."""

from __future__ import annotations

import gc
import os
import threading
import time

import psutil
import pytest
from _wait import wait_for

import monarch_nb

LINES = 100_000
RANKS = 4
CELLS = 1_000
MIB = 2**20
# Bounds for 1,000 cells; measured on a 2-core x86_64 VM: controller under +1 MiB, each
# worker under +1 MiB (the test prints the figures with -s).
CONTROLLER_GROWTH = 16 * MIB
WORKER_GROWTH = 16 * MIB


@pytest.fixture(scope="module")
def four():
    ctl = monarch_nb.up(workers=RANKS, cpu=True, current=False, dist=False)
    yield ctl
    ctl.down()


def test_100k_lines_across_4_ranks_arrive_whole_and_in_order(four, capsys):
    per_rank = LINES // RANKS
    # Each line is written in two pieces, so a line split across writes must be joined again;
    # lines differ per rank and get longer and shorter, so none can be merged or collapsed.
    four.run(
        "import sys\n"
        f"for i in range({per_rank}):\n"
        "    sys.stdout.write(f'r{rank} line {i:06d} ')\n"
        "    sys.stdout.write('x' * (i % 37) + '|\\n')\n",
        collapse=False,
    )
    out = capsys.readouterr().out.splitlines()
    assert len(out) == LINES
    for rank in range(RANKS):
        tag = f"[rank {rank}] "
        mine = [ln[len(tag) :] for ln in out if ln.startswith(tag)]
        assert mine == [f"r{rank} line {i:06d} " + "x" * (i % 37) + "|" for i in range(per_rank)]


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_1000_cells_leave_memory_threads_fds_and_metrics_bounded(four, capsys):
    four.metrics.set_limits(scalar_rows=200)  # small, so that 1,000 steps must overflow it
    cell = (
        "import monarch_nb\nmonarch_nb.log(step=n, loss=1.0 / (n + 1))\nprint('cell', n)\nn * rank"
    )
    for n in range(100):  # warm up: imports, caches, the first buffers
        four.run(f"n = {n}\n{cell}")
    capsys.readouterr()
    gc.collect()
    workers = [row["pid"] for row in four.status()]
    me = os.getpid()
    before = (rss(me), [rss(p) for p in workers], threading.active_count(), open_fds())

    for n in range(100, 100 + CELLS):
        mesh = four.run(f"n = {n}\n{cell}")
        assert mesh.item(RANKS - 1) == n * (RANKS - 1)
        if n % 100 == 0:
            capsys.readouterr()  # the output itself is not what is measured
    out = capsys.readouterr().out
    assert "[ranks 0-3] cell 1099" in out

    gc.collect()
    after = (rss(me), [rss(p) for p in workers], threading.active_count(), open_fds())
    grown = after[0] - before[0]
    worker_grown = [a - b for a, b in zip(after[1], before[1], strict=True)]
    print(
        f"\n{CELLS} cells: controller RSS {grown / MIB:+.1f} MiB, workers "
        + ", ".join(f"{g / MIB:+.1f}" for g in worker_grown)
        + f" MiB, threads {before[2]}->{after[2]}, fds {before[3]}->{after[3]}"
    )
    assert grown < CONTROLLER_GROWTH
    assert all(g < WORKER_GROWTH for g in worker_grown)
    assert after[2] <= before[2] + 2  # no thread per cell
    assert after[3] <= before[3] + 5  # no descriptor per cell
    assert [row["pid"] for row in four.status()] == workers  # the same worker processes

    # The metrics store keeps at most its limit per rank, here and on the scheduler.
    def settled():
        history = four.metrics.history()
        return len(history) == RANKS and all(h[-1].step == 99 + CELLS for h in history.values())

    assert wait_for(settled), "the last logged step did not reach the controller"
    assert all(len(rows) == 200 for rows in four.metrics.history().values())
    snapshot = four.metrics.scheduler_snapshot()
    assert len(snapshot["ranks"]) == RANKS
    assert all(len(r["scalars"]) <= 200 for r in snapshot["ranks"])


def _mine(out: str, rank: int) -> list[str]:
    tag = f"[rank {rank}] "
    return [ln[len(tag) :] for ln in out.splitlines() if ln.startswith(tag)]


def test_what_threads_a_cell_starts_print_arrives_tagged(four, capsys):
    """A thread's line goes to the cell that started it; a line printed after that cell ended,
    while no cell runs, opens the rank's next cell."""
    four.run(
        "import threading, time\n"
        "t = threading.Thread(target=lambda: print('from a thread', rank))\n"
        "t.start(); t.join()\n"
        "printed = threading.Event()\n"
        "def late():\n"
        "    print('late, from a grandchild', rank)\n"
        "    printed.set()\n"
        "def ticker():\n"  # outlives its cell
        "    time.sleep(0.3)\n"
        "    threading.Thread(target=late).start()\n"
        "threading.Thread(target=ticker, daemon=True).start()\n"
        "print('end of the first cell')",
        collapse=False,
    )
    first = capsys.readouterr().out
    time.sleep(0.6)  # the grandchild prints while no cell runs (or, if late, into the next)
    four.run("printed.wait(10)\nprint('second cell')", collapse=False)
    second = capsys.readouterr().out
    for rank in range(RANKS):
        assert _mine(first, rank) == [f"from a thread {rank}", "end of the first cell"]
        assert _mine(second, rank) == [f"late, from a grandchild {rank}", "second cell"]


def test_what_subprocesses_and_c_code_write_to_fds_1_and_2_arrives_tagged_in_order(four, capsys):
    four.run(
        "import ctypes, os, subprocess, sys\n"
        "print('before')\n"
        "subprocess.run(['echo', f'echo {rank}'])\n"
        "print('between')\n"
        "os.system(f'echo system {rank}')\n"
        "sys.stdout.buffer.write(b'bytes\\n')\n"
        "print('after')\n"
        "subprocess.run(['sh', '-c', f'echo to fd 2 {rank} >&2'])\n"
        "print('on stderr', file=sys.stderr)\n"
        "ctypes.CDLL(None).printf(b'printf %d\\n', rank)  # buffered by C: sent at the end\n"
        "None",
        collapse=False,
    )
    captured = capsys.readouterr()
    for rank in range(RANKS):
        assert _mine(captured.out, rank) == [
            "before",
            f"echo {rank}",
            "between",
            f"system {rank}",
            "bytes",
            "after",
            f"printf {rank}",
        ]
        assert _mine(captured.err, rank) == [f"to fd 2 {rank}", "on stderr"]


def test_what_dask_prints_outside_cells_stays_in_the_worker_log(capfd):
    """The worker's own stdout/stderr are this test's (capfd), inherited by a cluster started
    here. What Dask logs and prints on its event loop while a cell runs, and what a subprocess
    writes after its cell ended, reach them untagged; no cell shows them."""
    ctl = monarch_nb.up(workers=1, cpu=True, current=False, dist=False)
    try:
        ctl.run(
            "import logging, subprocess, time\n"
            "from monarch_nb.rank.engine import get_engine\n"
            "def dask_side():\n"
            "    print('dask prints')\n"
            "    logging.getLogger('distributed.worker').warning('dask logs')\n"
            "get_engine().worker.loop.add_callback(dask_side)\n"
            "time.sleep(0.5)\n"
            "subprocess.Popen(['sh', '-c', 'sleep 0.3; echo subprocess after its cell'])\n"
            "print('cell')"
        )
        out = err = ""
        for _ in range(100):  # until the subprocess has written, between the cells
            o, e = capfd.readouterr()
            out, err = out + o, err + e
            if "subprocess after its cell" in out:
                break
            time.sleep(0.1)
        ctl.run("print('next cell')")
        o, e = capfd.readouterr()
        out, err = out + o, err + e
    finally:
        ctl.down()
    assert _mine(out, 0) == ["cell", "next cell"]
    assert "dask prints\n" in out.splitlines(keepends=True)
    assert "subprocess after its cell\n" in out.splitlines(keepends=True)
    assert any(
        line.endswith("distributed.worker - WARNING - dask logs") for line in err.splitlines()
    )
    assert "[rank 0]" not in err
