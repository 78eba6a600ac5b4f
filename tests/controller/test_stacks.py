"""``%monarch stacks`` on real worker processes: a rank waiting in a gloo all_reduce its peer
has not joined yet, ranks asleep in a cell (grouped, the cell's frame marked), a stopped rank
reported within about a second, C frames through py-spy, an actor mesh's threads, and the
user's mistakes in one line each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from _wait import stop, wait_for
from IPython.core.error import UsageError

from monarch_nb import ClusterError
from monarch_nb.actors import Actor, endpoint
from monarch_nb.actors import mesh as actors
from monarch_nb.controller.stacks import ANSWER_WITHIN
from monarch_nb.dispatch.stacks_report import CELL_MARK
from monarch_nb.rank import stacks as rank_stacks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor below, by value


class Sleeper(Actor):
    @endpoint
    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    @endpoint
    async def doze(self, seconds):
        import asyncio

        await asyncio.sleep(seconds)
        return seconds


def _stacks_until(ctl, predicate, timeout=30, **kwargs):
    """Ask until ``predicate(report)``: the cells start on a loaded machine in their own time."""
    reports = []
    ok = wait_for(lambda: predicate(reports.append(ctl.stacks(**kwargs)) or reports[-1]), timeout)
    assert ok, reports[-1].text() if reports else "no report"
    return reports[-1]


def _sleeping(report, ranks) -> bool:
    return all(
        any("time.sleep" in f[3] for t in report.threads(r) for f in t["frames"]) for r in ranks
    )


def test_a_rank_waiting_in_all_reduce_is_named_with_its_number(clean):
    before = clean.rank_info([0, 1])[0]["info"]["collectives"]
    handle = clean.run(
        "import time, torch, torch.distributed as dist\n"
        "dist.all_reduce(torch.ones(1))\n"
        "def late():\n"
        "    time.sleep(5)\n"
        "if rank == 1:\n"
        "    late()\n"
        "dist.all_reduce(torch.ones(1))\n",
        block=False,
    )
    # until rank 1 sleeps in late() and rank 0 has left the first all_reduce for the second
    # (on a loaded machine its thread may not have returned from the first yet): between two
    # lines the summary names those lines
    n = before + 2
    expected = rf"rank 0 waits in all_reduce #{n}; rank 1 is at #{n - 1}, in cell \d+, line 4"
    report = _stacks_until(clean, lambda r: re.fullmatch(expected, r.summary or ""))
    assert re.fullmatch(expected, report.summary), report.text()
    text = report.text()
    # rank 0's cell is in the collective, rank 1's in the function it called, its frame shown
    assert "[rank 0] the cell's thread, running for" in text
    assert f"waits in all_reduce #{n}" in text
    rank1 = text.split("[rank 1] the cell's thread", 1)[1]
    assert 'File "<monarch cell ' in rank1 and CELL_MARK in rank1, text
    assert "in late\n    time.sleep(5)" in rank1, text
    assert handle.result(timeout=60).values() == [None, None]


def test_ranks_asleep_in_a_cell_are_grouped_with_the_cell_frame_marked(clean):
    handle = clean.run("import time\ndef nap():\n    time.sleep(3)\nnap()", block=False)
    report = _stacks_until(clean, lambda r: _sleeping(r, [0, 1]))
    assert report.elapsed < 1.0, report.elapsed
    assert report.silent == {}
    cells = [(ranks, t) for ranks, t in report.groups() if t["kind"] == "cell"]
    assert [ranks for ranks, _ in cells] == [[0, 1]], report.text()
    frames = cells[0][1]["frames"]
    assert [f[2] for f in frames] == ["<module>", "nap"]
    assert cells[0][1]["cell"] == 0 and frames[0][0].startswith("<monarch cell ")
    text = report.text()
    assert re.search(
        r'File "<monarch cell \d+>", line 4, in <module>   <- the cell\n    nap\(\)', text
    )
    assert report.summary is None  # no rank in a collective, and their counts agree
    assert "the worker's own" in text and "'MainThread'" not in text
    assert "'MainThread'" in report.text(everything=True)
    assert "<b>" in report._repr_html_() and repr(report).startswith("<StacksReport of ranks 0-1")
    handle.result(timeout=60)


def test_a_cell_awaiting_shows_its_task_with_the_cell_frame_marked(clean):
    handle = clean.run(
        "import asyncio\nasync def later():\n    await asyncio.sleep(3)\nawait later()",
        block=False,
    )
    both = "[ranks 0-1] the cell's thread"
    report = _stacks_until(
        clean, lambda r: re.search(re.escape(both) + ".*: 1 task awaiting", r.text())
    )
    text = report.text()
    assert re.search(
        r"\[ranks 0-1\] the cell's thread, running for \d+ s: 1 task awaiting\n"
        r'  task 1, awaiting:\n    File "<monarch cell \d+>", line 4, in <module>   <- the cell\n'
        r"      await later\(\)\n"
        r'    File "<monarch cell \d+>", line 3, in later\n',
        text,
    ), text
    assert re.fullmatch(r"cell \d+, line 3", report._stacks[0]["where"])
    handle.result(timeout=60)


def test_a_stopped_rank_is_reported_not_answering_within_a_second(clean):
    pid = clean.run("import os\nos.getpid()", targets=[1]).item(1)
    clean.unanswering.discard(1)
    stop(pid)
    try:
        start = time.monotonic()
        report = clean.stacks()
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < ANSWER_WITHIN + 0.5, took
    assert list(report.silent) == [1]
    assert report.silent[1].startswith(f"not answering: its worker process (pid {pid}) is stopped")
    assert report.threads(0)
    assert f"[rank 1 on {clean.ranks[1].host}] not answering" in report.text()
    with pytest.raises(KeyError, match="rank 1 sent no stacks: not answering"):
        report.threads(1)
    assert wait_for(lambda: not clean.stacks().silent, 10)  # it answers again once let go on


def test_native_adds_c_frames_through_py_spy(clean):
    if rank_stacks._py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'monarch-nb[stacks]')")
    handle = clean.run("import time\ntime.sleep(5)", block=False)
    _stacks_until(clean, lambda r: _sleeping(r, [0, 1]))
    report = clean.stacks(native=True)
    text = report.text()
    assert report.silent == {}, text
    assert "note" not in report._stacks[0], report._stacks[0].get("note")
    assert "[C] " in text and "sleep" in text.split("[C] ", 1)[1], text
    assert CELL_MARK in text
    handle.result(timeout=60)


def test_native_without_py_spy_says_how_to_get_it_in_one_line(tmp_path):
    # A Python with no py-spy beside it or on PATH: the base interpreter of the venv.
    base = os.path.realpath(sys.executable)
    if os.access(os.path.join(os.path.dirname(base), "py-spy"), os.X_OK):
        pytest.skip("py-spy is installed beside the base interpreter too")
    code = (
        "from monarch_nb.rank.stacks import NativeUnavailable, py_spy_dump\n"
        "try:\n    py_spy_dump(1)\nexcept NativeUnavailable as e:\n    print(e)"
    )
    path = os.pathsep.join([str(Path(rank_stacks.__file__).parents[2]), *sys.path[1:]])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": path}
    out = subprocess.run([base, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout == "--native needs py-spy on the ranks: pip install 'monarch-nb[stacks]'\n"


def test_py_spy_failing_is_one_line():
    if rank_stacks._py_spy() is None:
        pytest.skip("py-spy is not installed (pip install 'monarch-nb[stacks]')")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(rank_stacks.NativeUnavailable) as info:
        rank_stacks.py_spy_dump(gone.pid)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("py-spy could not read the worker process: ")


def test_an_actor_mesh_shows_its_actors_threads(ctl):
    mesh = actors.proc_mesh(ctl).spawn("sleepers", Sleeper)
    try:
        future = mesh.nap.call(3)
        report = wait_for_actor(mesh)
        groups = report.groups()
        assert [ranks for ranks, _ in groups] == [[0, 1]], report.text()
        text = report.text()
        assert text.startswith("stacks of actor 'sleepers' on ranks 0-1")
        # a class sent by value has no source file to quote: the frame's name says it
        assert "[ranks 0-1] actor 'sleepers'" in text and ", in nap" in text
        assert "the cell's thread" not in text
        assert future.get(timeout=60).values() == [3, 3]
        idle = mesh.stacks()
        assert "actor 'sleepers': idle, waiting for its next call" in idle.text()
        # an async endpoint awaiting leaves no frame on the thread: its task's stack is shown
        future = mesh.doze.call(3)
        reports = []
        both = "[ranks 0-1] actor 'sleepers': 1 task awaiting\n  task 1, awaiting:"
        assert wait_for(lambda: both in _last(reports, mesh.stacks()).text(), 30), reports[-1]
        text = reports[-1].text()
        assert ", in doze\n" in text
        assert future.get(timeout=60).values() == [3, 3]
    finally:
        mesh.stop().get(timeout=10)


def _last(reports, report):
    reports.append(report)
    return report


def wait_for_actor(mesh):
    reports = []

    def napping(report):
        return all(
            any(f[2] == "nap" for t in report.threads(r) for f in t["frames"]) for r in (0, 1)
        )

    ok = wait_for(lambda: napping(reports.append(mesh.stacks()) or reports[-1]), 30)
    assert ok, reports[-1].text()
    return reports[-1]


def test_a_blocking_cell_is_seen_from_another_thread(clean):
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(_stacks_until(clean, lambda r: _sleeping(r, [0, 1])))
    )
    thread.start()
    clean.run("import time\ntime.sleep(2.5)")
    thread.join(30)
    assert seen and seen[0].summary is None and not seen[0].silent


def test_the_magic_and_its_mistakes(clean, cell):
    report = cell("%monarch stacks --targets 1")
    assert report.ranks == [1] and "[rank 1] no cell running" in report.text()
    assert "'MainThread'" in cell("%monarch stacks --all").text()
    cell("%monarch stacks --targets 5", expect_error=True)
    assert isinstance(cell.error, UsageError)
    assert str(cell.error) == (
        "target spec '5': rank 5 is out of range; this cluster has ranks 0..1"
    )


def test_no_cluster_is_one_line(no_current, cell):
    cell("%monarch stacks", expect_error=True)
    assert isinstance(cell.error, UsageError)
    assert "no cluster is up; start one with %monarch up" in str(cell.error)


def test_a_cluster_that_is_down_says_so():
    import monarch_nb

    other = monarch_nb.up(workers=1, cpu=True, current=False, dist=False)
    other.down()
    with pytest.raises(ClusterError, match="this cluster is down; start one with %monarch up"):
        other.stacks()


def test_64_ranks_stacks_fit_one_screen_with_the_silent_ones_in_one_line():
    from monarch_nb.dispatch.stacks_report import StacksReport

    frames = [["<cell-1>", 3, "<module>", "time.sleep(60)", False]]
    thread = {"name": "monarch-engine", "kind": "cell", "actor": None, "frames": frames}
    ok = {"threads": [{**thread, "cell": 0, "tasks": [], "collective": None}], "running": True}
    silent = {3: "node-a", 5: "node-a", 40: "node-f"}
    outcomes = {
        r: {"status": "ok", "stacks": ok}
        if r not in silent
        else {"status": "unanswered", "why": f"not answering: its worker process (pid {900 + r})"}
        for r in range(64)
    }
    hosts = {r: silent.get(r, "node-a") for r in range(64)}
    lines = StacksReport(list(range(64)), hosts, outcomes, 0.5).text().splitlines()
    assert lines[1:3] == [
        "[ranks 3,5 on node-a] not answering: its worker process (pid 903..905)",
        "[rank 40 on node-f] not answering: its worker process (pid 940)",
    ]
    assert "[ranks 0-2,4,6-39,41-63] the cell's thread" in lines
    assert len(lines) <= 10, lines
