"""Signals and a worker that cannot answer: a rank stopped (SIGSTOP) or holding the GIL, Ctrl-C
at each stage of a command, writes to a rank that does not read, and the names values are
stored under. Ctrl-C returns within about 2 s and ``--timeout T`` within about T + 2 s, with
one line per rank that does not answer and the other ranks' results kept.

The time bounds leave room for a loaded machine and still fail without the fix: before it, each
case below waited out a 2 s question and the 5 s collective check on top of the grace."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import numpy as np
import pytest
from _wait import stop, wait_for

import monarch_nb
from monarch_nb import CellError, CellTimeout, ClusterError
from monarch_nb import errors as module
from monarch_nb.dispatch.results import Interrupted


def interrupt_after(seconds: float) -> None:
    threading.Timer(seconds, _thread.interrupt_main).start()


def sigint_after(seconds: float) -> None:
    """A real SIGINT, which also cuts short a blocking call (a sleep) in the main thread."""
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


@pytest.fixture(scope="module")
def own():
    """A 2-rank cluster with its process group (the check after an interrupt asks the ranks),
    whose worker processes a test may stop: they are let go on before the next test."""
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    ctl.pids = ctl.run("import os\nos.getpid()").values()
    yield ctl
    for pid in ctl.pids:
        os.kill(pid, signal.SIGCONT)
    ctl.down()


@pytest.fixture
def stopped(own):
    """Rank 1's worker process stopped from outside (SIGSTOP), and current for the magics."""
    saved = module.current()
    module.set_current(own)
    stop(own.pids[1])
    try:
        yield own
    finally:
        os.kill(own.pids[1], signal.SIGCONT)
        module.set_current(saved)
        # The cells queued while it was stopped run or are dropped before the next test.
        own.run("None", timeout=30)


def test_timeout_with_a_stopped_rank_names_it_and_keeps_the_other_ranks_result(stopped, cell):
    pid = stopped.pids[1]
    start = time.monotonic()
    cell("%%monarch --timeout 2 --out res\nrank * 10", expect_error=True)
    took = time.monotonic() - start
    assert took < 6, took  # 2 s + about 2 s; it was 10.5 s
    assert isinstance(cell.error, CellTimeout)
    assert cell.shell.user_ns["res"].to_dict() == {0: 0}
    lines = cell.error._render_traceback_()
    assert any(
        line.startswith("[rank 1] ")
        and f"NotAnswering: not answering: its worker process (pid {pid}) is stopped; "
        f"kill -CONT {pid} lets it go on"
        in line
        for line in lines
    ), lines

    start = time.monotonic()
    cell("%monarch status")
    assert time.monotonic() - start < 2.5  # it was 5 s
    row = next(line.split() for line in cell.out.splitlines() if line.startswith("1 "))
    assert row[2] == str(pid) and "not answering" in " ".join(row), cell.out
    assert "cpu:" in " ".join(row)  # what is known about it is kept

    os.kill(pid, signal.SIGCONT)
    assert stopped.run("rank", timeout=30).values() == [0, 1]
    cell("%monarch status")
    row = next(line for line in cell.out.splitlines() if line.startswith("1 "))
    assert "not answering" not in cell.out and "idle" in row


def test_status_answers_at_once_the_first_time_it_meets_a_stopped_rank(stopped, cell):
    """A worker stopped on this machine is known as such from /proc: its rank gets the short
    wait of one that did not answer before, not the 2 s a rank still thought to answer gets."""
    pid = stopped.pids[1]
    assert 1 not in stopped.unanswering  # nothing has asked it since it was stopped
    start = time.monotonic()
    cell("%monarch status")
    took = time.monotonic() - start
    assert took < 1.5, took  # 0.3 s; it was 2.0 s, the whole wait, the first time
    row = next(line.split() for line in cell.out.splitlines() if line.startswith("1 "))
    assert row[2] == str(pid) and "not answering" in " ".join(row), cell.out
    assert "idle" in next(line for line in cell.out.splitlines() if line.startswith("0 "))


def test_ctrl_c_with_a_stopped_rank_returns_within_about_two_seconds(stopped, cell):
    interrupt_after(1.0)
    start = time.monotonic()
    cell("%%monarch\nimport time\nfor _ in range(200):\n    time.sleep(0.05)", expect_error=True)
    took = time.monotonic() - start - 1.0
    assert took < 4.5, took  # about 2 s; it was 8.5 s
    errors = cell.error.errors
    assert errors[0].ename == "KeyboardInterrupt"  # rank 0 was interrupted as ever
    assert errors[1].ename == "NotAnswering" and "is stopped" in errors[1].evalue
    # The next cell queues behind the stopped rank and times out in T + about 2 s.
    cell.capsys.readouterr()
    start = time.monotonic()
    with pytest.raises(CellTimeout) as info:
        stopped.run("rank", timeout=2)
    assert time.monotonic() - start < 6
    assert info.value.results.to_dict() == {0: 0}
    assert (
        "rank 1 is busy with an earlier cell, and rank 1 did not answer when last asked; "
        "this cell waits for it" in cell.capsys.readouterr().err
    )


def test_a_large_push_to_a_stopped_rank_is_cut_short_and_the_data_path_stays_whole(stopped):
    big = np.arange(8_000_000, dtype=np.float64)  # 64 MB: far more than a socket buffer holds
    interrupt_after(5.0)  # rank 0 has it by then (2.5 s was too short on a slow run)
    start = time.monotonic()
    with pytest.raises(CellError) as info:
        stopped.push({"big": big})
    # cut short: to a rank that stays stopped the push would otherwise wait for ever (measured:
    # back about 0.5 s after the interrupt)
    assert time.monotonic() - start < 30
    assert set(info.value.errors) == {1} and info.value.errors[1].ename == "NotAnswering"
    os.kill(stopped.pids[1], signal.SIGCONT)
    # The push reaches rank 1 whole once it goes on (and the interrupt drops or stops it):
    # half a frame there would have left its thread dead on an unreadable stream.
    assert stopped.run("'big' in globals()", timeout=30).values()[0] is True
    assert stopped.run("big[-1]", targets=0, timeout=30).item() == big[-1]


def test_a_large_push_behind_a_running_cell_is_cancelled_and_the_data_path_stays_whole(own):
    handle = own.run("import time\nfor _ in range(40):\n    time.sleep(0.05)", block=False)
    big = np.arange(8_000_000, dtype=np.float64)
    interrupt_after(1.0)
    with pytest.raises(CellError) as info:
        own.push({"big2": big})
    assert {e.ename for e in info.value.errors.values()} == {"Cancelled"}
    assert handle.result(timeout=30).values() == [None, None]
    assert own.run("'big2' in globals()", timeout=30).values() == [False, False]


def test_a_rank_holding_the_gil_is_named_not_answering():
    ctl = monarch_nb.up(workers=2, cpu=True, current=False, dist=False)
    try:
        pid = ctl.run("import os\nos.getpid()", targets=1).item()
        regex = "import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')"  # hours, the GIL held
        start = time.monotonic()
        with pytest.raises(CellTimeout) as info:
            ctl.run(regex, targets=1, timeout=2)
        assert time.monotonic() - start < 6
        err = info.value.errors[1]
        assert err.ename == "NotAnswering"
        assert f"(pid {pid}) runs but its event loop does not" in err.evalue
        start = time.monotonic()
        rows = ctl.status()
        assert time.monotonic() - start < 2.5
        assert rows[1]["state"] == "not answering" and rows[1]["pid"] == pid
        assert rows[0]["state"] == "idle"
        assert f"kill -KILL {pid} has its nanny start a fresh one" in err.evalue
        os.kill(pid, signal.SIGKILL)  # what the line says to do: the replacement attaches
        notices: list[str] = []
        assert wait_for(
            lambda: notices.extend(ctl.notices()) or any("replacement" in n for n in notices)
        ), notices
        assert ctl.run("rank", timeout=30).values() == [0, 1]
        assert ctl.status()[1]["state"] == "idle"
    finally:
        ctl.down()


def test_ctrl_c_while_the_result_is_unpickled_is_one_line(cell, clean):
    cell(
        "%%monarch\nimport time\n"
        "class Slow:\n    def __reduce__(self):\n        return (time.sleep, (5,))\n"
    )
    sigint_after(1.0)
    start = time.monotonic()
    cell("%%monarch\nSlow()", expect_error=True)  # unpickled here, it sleeps 5 s
    assert time.monotonic() - start < 4
    assert isinstance(cell.error, Interrupted)
    assert cell.error._render_traceback_() == [
        "KeyboardInterrupt: interrupted while the results of ranks 0-1 were unpickled here; "
        "they are not kept (keep a value in a name on the ranks and %monarch pull it)"
    ]
    assert clean.run("rank").values() == [0, 1]


def test_interrupting_a_handle_after_down_is_one_line(no_current):
    ctl = monarch_nb.up(workers=1, cpu=True, current=False, dist=False)
    handle = ctl.run("import time\ntime.sleep(30)", block=False)
    ctl.down()
    with pytest.raises(ClusterError) as info:
        handle.interrupt()
    assert info.value._render_traceback_() == [
        "ClusterError: this cluster is down, and its cells ended with it"
    ]
    with pytest.raises(ClusterError):
        ctl.interrupt()


# -- names -------------------------------------------------------------------------------------
def test_names_are_normalised_as_python_reads_them(cell, clean):
    cell("%monarch push ﬁ=1")  # the ligature: Python reads the name ﬁ as fi
    assert cell("%monarch pull ﬁ").values() == [1, 1]
    assert cell("%monarch pull fi").values() == [1, 1]
    clean.push({"ﬀ": 2})
    assert clean.run("ﬀ + ff").values() == [4, 4]
    clean.scatter("ﬃ", [5, 6])
    assert clean.gather("ﬃ") == [5, 6]
    cell("%%monarch --out ﬁx\nrank")
    assert cell.shell.user_ns["fix"].values() == [0, 1]
    assert "ﬁx" not in cell.shell.user_ns


@pytest.mark.parametrize("name", ["get_ipython", "Out", "_oh", "In", "__builtins__", "_", "_5"])
def test_out_refuses_the_names_ipython_keeps(cell, clean, name):
    before = cell.shell.user_ns.get(name)
    cell(f"%%monarch --out {name}\nrank", expect_error=True)
    assert str(cell.error) == (
        f"--out cannot store as {name!r}: IPython keeps that name for itself; use another"
    )
    assert cell.shell.user_ns.get(name) is before


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("get_ipython=1", "monarch-nb sets it on every rank"),
        ("rank=3", "monarch-nb sets it on every rank"),
        ("__builtins__=1", "Python keeps that name for itself; use another"),
        ("__name__='x'", "Python keeps that name for itself; use another"),
    ],
)
def test_push_refuses_the_names_the_ranks_keep(cell, clean, item, why):
    name = item.split("=")[0]
    cell(f"%monarch push {item}", expect_error=True)
    assert str(cell.error).startswith(f"cannot push to {name!r}: {why}")
    assert clean.run("(rank, get_ipython() is not None, __name__)").values() == [
        (0, True, "__main__"),
        (1, True, "__main__"),
    ]
    with pytest.raises(ValueError, match="cannot scatter to"):
        clean.scatter(name, [1, 2])


def test_auto_mode_without_a_cluster_says_so(cell, no_current):
    cell("%monarch auto on")
    try:
        cell("1 + 1", expect_error=True)
        assert "auto mode is on" in str(cell.error) and "%monarch auto off" in str(cell.error)
    finally:
        cell("%monarch auto off")
    assert cell("1 + 1") == 2


def test_interrupting_a_background_cell_with_a_stopped_rank_ends_it(stopped):
    handle = stopped.run("import time\nfor _ in range(600):\n    time.sleep(0.05)", block=False)
    time.sleep(0.5)
    start = time.monotonic()
    handle.interrupt()
    with pytest.raises(CellError) as info:
        handle.result(timeout=8)  # it waited for the stopped rank for ever
    assert time.monotonic() - start < 6
    assert info.value.errors[0].ename == "KeyboardInterrupt"
    assert info.value.errors[1].ename == "NotAnswering"


def test_the_stop_button_with_a_stopped_worker_returns_within_seconds(tmp_path, monkeypatch):
    """In a real kernel: JupyterLab's stop button (SIGINT to the kernel's process group) while
    a rank's worker is stopped."""
    from test_faults import Kernel

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    kernel = Kernel(tmp_path)
    try:
        kernel.up()
        out = kernel.run("%%monarch --targets 1\nimport os\nprint('pid', os.getpid())")
        pid = int(out.split("pid", 1)[1].split()[0])
        stop(pid)
        try:
            msg_id = kernel.kc.execute(
                "%%monarch\nimport time\nfor _ in range(200):\n    time.sleep(0.05)"
            )
            time.sleep(1.5)
            start = time.monotonic()
            kernel.km.interrupt_kernel()
            reply = kernel.interrupted(msg_id)
            # About 2 s, and the live panel's 2 s to collect the metrics; it never returned
            # (the panel asked every worker for its metrics without a bound).
            assert time.monotonic() - start < 7
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reply["content"]["status"] == "error"
        shown = "\n".join(reply["content"]["traceback"])
        assert "[rank 0] KeyboardInterrupt" in shown
        assert f"NotAnswering: not answering: its worker process (pid {pid}) is stopped" in shown
        assert "[ranks 0-1] alive" in kernel.run("%%monarch\nprint('alive')")
    finally:
        kernel.close()


def test_ctrl_c_reaches_busy_ranks_while_the_notebooks_event_loop_is_held(clean):
    # The event loop that writes the control comm is the scheduler's and the nannies' too; 64
    # busy ranks on 2 cores starved it for seconds, and the interrupt waited behind it until
    # the ranks were reported as not answering. Here it is held for 3 s by a callback.
    held = threading.Event()
    clean._loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(3)))
    assert held.wait(10)
    sigint_after(0.5)
    with pytest.raises(CellError) as info:
        clean.run("x = 0\nwhile True:\n    x += 1")
    assert {e.ename for e in info.value.errors.values()} == {"KeyboardInterrupt"}
    assert info.value.headline == "interrupted ranks 0-1"
    assert clean.run("rank").values() == [0, 1]


def test_interrupt_names_the_cells_it_stopped_when_its_direct_path_wins(clean):
    # The interrupt reaches a rank on this host straight away, while the question of what it
    # stopped waits for the event loop: the cells have ended by the time it is answered, and
    # the ranks were reported as running nothing. Each rank keeps what each press hit.
    handle = clean.run("while True: pass", block=False)
    assert wait_for(lambda: all(r["state"].startswith("busy") for r in clean.status()), 10)
    held = threading.Event()
    clean._loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(1)))
    assert held.wait(10)
    assert str(clean.interrupt(wait=True)) == "interrupted ranks 0-1"
    with pytest.raises(CellError, match="KeyboardInterrupt"):
        handle.result(timeout=30)
    assert str(clean.interrupt(wait=True)) == "ranks 0-1 were running nothing"
