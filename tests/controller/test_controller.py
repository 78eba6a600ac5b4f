"""The controller API against a real LocalCluster-style cluster of worker processes."""

from __future__ import annotations

import _thread
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from _wait import running, wait_for
from IPython.utils.capture import capture_output

import monarch_nb
from monarch_nb import CellError, CellTimeout, UnserializableResult, ValueMesh


def test_cells_run_on_every_rank_in_persistent_namespaces(clean):
    assert clean.run("x = rank * 10") == ValueMesh({0: None, 1: None})
    mesh = clean.run("x + 1")
    assert mesh.values() == [1, 11]
    assert mesh.item(1) == 11
    assert list(mesh) == [1, 11]
    assert mesh.items() == [(0, 1), (1, 11)]


def test_identity_names(clean):
    mesh = clean.run("(rank, world_size, local_rank, host, str(device))")
    for r, (rank, world, local, host, device) in mesh.items():
        assert (rank, world, local, device) == (r, 2, r, "cpu")
        assert host


def test_output_order_per_rank_and_collapse(clean, capsys):
    clean.run("for i in range(300): print(f'line {i} of rank {rank}')\nprint('same everywhere')")
    out = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        mine = [ln for ln in out if ln.startswith(f"[rank {r}] line")]
        assert mine == [f"[rank {r}] line {i} of rank {r}" for i in range(300)]
    assert out.count("[ranks 0-1] same everywhere") == 1


def test_no_collapse_shows_each_copy(clean, capsys):
    clean.run("print('hello')", collapse=False)
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[rank 0] hello", "[rank 1] hello"]


def test_stderr_and_carriage_return_progress(clean, capsys):
    clean.run(
        "import sys\n"
        "for p in (10, 50, 100): print(f'\\r{p}%', end='')\n"
        "print()\n"
        "print('oops', file=sys.stderr)"
    )
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[ranks 0-1] 100%"]
    assert captured.err.splitlines() == ["[ranks 0-1] oops"]


def test_rich_output_is_shown_tagged_with_the_rank(clean, shell):
    code = (
        "class Fancy:\n"
        "    def _repr_html_(self): return f'<b>rank {rank}</b>'\n"
        "    def __repr__(self): return 'Fancy()'\n"
        "display(Fancy())\n"
        "from IPython.display import display as ipy_display, Markdown\n"
        "ipy_display(Markdown('*md*'))"
    )
    with capture_output() as io:
        clean.run(code, targets=[1])
    bundles = [o.data for o in io.outputs]
    assert {"text/html": "<b>rank 1</b>", "text/plain": "Fancy()"}.items() <= bundles[0].items()
    assert bundles[1]["text/markdown"] == "*md*"
    assert "[rank 1]" in io.stdout


def test_a_display_with_an_id_is_updated_in_place(clean, shell):
    code = (
        "from IPython.display import update_display\n"
        "h = display('step 0', display_id=True)\n"
        "h.update('step 1')\n"
        "update_display('step 2', display_id=h.display_id)\n"
        "h.display_id"
    )
    with capture_output() as io:
        did = clean.run(code, targets=[0]).item(0)
    shown = [
        (o.data["text/plain"], o.update, (o.transient or {}).get("display_id")) for o in io.outputs
    ]
    assert shown == [("'step 0'", False, did), ("'step 1'", True, did), ("'step 2'", True, did)]
    assert io.stdout.count("[rank 0]") == 1  # the tag once, above the output updated in place


def test_clear_output_on_a_rank_clears_the_cells_output(clean, shell):
    code = (
        "from IPython.display import clear_output\n"
        "display('epoch 1')\n"
        "print('50%', end='')\n"
        "clear_output(wait=True)\n"
        "display('epoch 2')"
    )
    with capture_output() as io:
        clean.run(code, targets=[1])
    assert [o.data["text/plain"] for o in io.outputs] == ["'epoch 2'"]
    assert "50%" not in io.stdout  # an unfinished line goes with the rest


def test_syntax_error_is_reported_before_anything_is_sent(clean):
    with pytest.raises(SyntaxError):
        clean.run("marker = 1\nbad = (")
    with pytest.raises(NameError, match="marker is not defined on ranks 0-1"):
        clean.pull("marker")


def test_errors_on_some_ranks_keep_the_others_results(clean):
    with pytest.raises(CellError) as info:
        clean.run("a = 1\nb = 2\n1 / 0 if rank == 1 else rank + 100")
    err = info.value
    assert err.headline == "1 of 2 ranks failed"
    assert err.results.to_dict() == {0: 100}
    remote = err.errors[1]
    assert (remote.rank, remote.ename) == (1, "ZeroDivisionError")
    text = "\n".join(err._render_traceback_())
    assert "line 3, in <module>" in text and "1 / 0 if rank == 1" in text
    assert "engine.py" not in text and "threading.py" not in text


def test_distinct_tracebacks_are_shown_once_with_their_ranks(clean):
    with pytest.raises(CellError) as info:
        clean.run("raise ValueError('same')")
    groups = info.value.groups()
    assert len(groups) == 1 and groups[0][0] == [0, 1]
    assert info.value._render_traceback_()[:3] == [
        "2 of 2 ranks failed",
        "",
        "[ranks 0-1] ValueError: same",
    ]
    with pytest.raises(CellError) as info:  # one traceback, each rank's own message
        clean.run("raise ValueError(f'bad loss on rank {rank}')")
    assert len(info.value.groups()) == 1
    shown = info.value._render_traceback_()
    assert shown[2] == "[ranks 0-1] ValueError, each rank's message below"
    assert shown[-2:] == [
        "[rank 0] ValueError: bad loss on rank 0",
        "[rank 1] ValueError: bad loss on rank 1",
    ]
    assert sum("Traceback" in line for line in shown) <= 1


def test_traceback_inside_a_function_defined_in_an_earlier_cell(clean):
    clean.run("def f(x):\n    return 1 / x")
    with pytest.raises(CellError) as info:
        clean.run("f(0)")
    text = "\n".join(info.value.errors[0].traceback)
    assert "in f" in text and "return 1 / x" in text


def test_an_unserializable_result_says_why_and_others_arrive(clean):
    mesh = clean.run("import threading\nthreading.Lock() if rank == 1 else 'fine'")
    assert mesh.item(0) == "fine"
    bad = mesh.item(1)
    assert isinstance(bad, UnserializableResult)
    assert "cannot pickle" in bad.reason and "lock" in repr(bad)


def test_push_pull_scatter_gather(clean):
    clean.push({"lr": 0.5, "t": torch.arange(3)})
    mesh = clean.pull(["lr", "t"])
    assert mesh.item(1)[0] == 0.5 and torch.equal(mesh.item(1)[1], torch.arange(3))
    clean.scatter("chunk", list(range(5)))
    assert clean.pull("chunk").values() == [[0, 1, 2], [3, 4]]  # the larger chunk first
    assert clean.gather("chunk") == [0, 1, 2, 3, 4]
    clean.scatter("tt", torch.arange(6.0))
    assert torch.equal(clean.gather("tt"), torch.arange(6.0))
    clean.push({"only_one": 1}, targets="1")
    with pytest.raises(NameError, match="only_one is not defined on rank 0"):
        clean.pull("only_one")


def test_pull_fails_naming_a_value_that_cannot_travel(clean):
    clean.run(
        "import threading, types, sys\n"
        "lk = threading.Lock()\n"
        "y = 5\n"
        "m = types.ModuleType('only_on_the_worker')\n"
        "exec('class K: pass', m.__dict__)\n"
        "sys.modules[m.__name__] = m\n"
        "k = m.K() if rank == 1 else None"
    )
    with pytest.raises(ValueError, match=r"^cannot pull 'lk' from ranks 0-1: lock cannot be"):
        clean.pull(["y", "lk"])
    with pytest.raises(ValueError, match=r"^cannot pull 'k' from rank 1: it cannot be unpickled"):
        clean.pull("k")
    assert clean.pull(["y", "k"], targets=0).values() == [(5, None)]


def test_gather_stacks_0d_tensors_and_arrays(clean):
    clean.run("import torch, numpy as np\nloss = torch.tensor(float(rank))\nz = np.float64(rank)")
    assert torch.equal(clean.gather("loss"), torch.tensor([0.0, 1.0]))
    assert clean.gather("z").tolist() == [0.0, 1.0]
    clean.run("y = 1 if rank else [1]")
    with pytest.raises(ValueError, match=r"cannot gather 'y': the ranks' values \(int, list\) do"):
        clean.gather("y")


def test_scatter_sends_each_rank_only_its_chunk_of_a_tensor(clean):
    clean.scatter("part", torch.arange(1000.0))
    assert clean.run("(part.numel(), part.untyped_storage().nbytes())").values() == [
        (500, 2000),
        (500, 2000),
    ]


def test_a_line_longer_than_the_partial_limit_is_one_line(clean, capsys):
    clean.run("print('x' * 70_000)\nprint('after')", targets=0)
    assert capsys.readouterr().out.splitlines() == ["[rank 0] " + "x" * 70_000, "[rank 0] after"]


def test_classes_defined_in_a_cell_pickle_on_the_worker(clean):
    clean.run("import pickle\nclass Point:\n    def __init__(self, x):\n        self.x = x")
    assert clean.run("pickle.loads(pickle.dumps(Point(rank))).x").values() == [0, 1]
    # __main__ is the namespace while a cell runs, and the worker's own again after
    assert clean.run("import __main__\nvars(__main__) is globals()").values() == [True, True]
    assert clean.call(lambda engine: sys.modules["__main__"] is engine.main).values() == [
        False,
        False,
    ]


def scaled(x, by=1):
    print("scaling", x)
    return x * by


def test_apply_runs_a_function_on_every_rank_after_the_cells_before_it(clean, capsys):
    assert clean.apply(scaled, 3, by=2).values() == [6, 6]
    assert "[ranks 0-1] scaling 3" in capsys.readouterr().out
    assert clean.apply(lambda: 7, targets="1").items() == [(1, 7)]
    # Queued behind a cell still running, as a cell would be: it sees what the cell did.
    clean.run("import os, time\ntime.sleep(0.5)\nos.environ['APPLY_SEES'] = str(rank)", block=False)
    try:
        assert clean.apply(lambda: os.environ["APPLY_SEES"]).values() == ["0", "1"]
    finally:
        clean.run("del os.environ['APPLY_SEES']")


def test_apply_errors_show_the_functions_own_frames(clean):
    with pytest.raises(CellError) as info:
        clean.apply(scaled, None, by=2)
    rendered = "\n".join(info.value.errors[0].traceback)
    assert "in scaled" in rendered and "TypeError" in rendered
    assert "monarch_nb/" not in rendered  # the rank's own frames are left out
    with pytest.raises(TypeError, match="apply takes a function to run on the ranks, got int"):
        clean.apply(3)
    with pytest.raises(TypeError, match="apply: scaled or its arguments cannot be sent"):
        clean.apply(scaled, threading.Lock())


def test_map_splits_the_items_over_the_ranks_and_keeps_their_order(clean):
    assert clean.map(scaled, range(5), [1, 2, 3, 4, 5]) == [0, 2, 6, 12, 20]
    assert clean.map(lambda x: (x, os.getpid()), "ab")[0][0] == "a"
    pids = {pid for _, pid in clean.map(lambda x: (x, os.getpid()), "abc")}
    assert pids == set(clean.apply(os.getpid).values())  # contiguous chunks, one per rank
    assert clean.map(scaled, [1], targets="1") == [1]
    assert clean.map(scaled, []) == []
    with pytest.raises(CellError) as info:
        clean.map(scaled, [1, None, 3, 4])
    assert set(info.value.errors) == {0}
    assert "in scaled" in "\n".join(info.value.errors[0].traceback)
    with pytest.raises(ValueError, match=r"different lengths \(2, 3\)"):
        clean.map(scaled, [1, 2], [1, 2, 3])
    with pytest.raises(TypeError, match="map needs at least one sequence"):
        clean.map(scaled)
    with pytest.raises(TypeError, match="map: scaled or its items cannot be sent"):
        clean.map(scaled, [threading.Lock()])


def test_push_of_something_unpicklable_names_it(clean):
    with pytest.raises(ValueError, match=r"cannot push 'lk': lock cannot be pickled"):
        clean.push({"lk": threading.Lock()})
    with pytest.raises(TypeError, match="scatter needs a sequence"):
        clean.scatter("n", 5)


def test_interrupt_a_busy_loop_on_two_ranks(clean):
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    with pytest.raises(CellError) as info:
        clean.run("n = 0\nwhile True: n += 1")
    elapsed = time.monotonic() - start - 1.0
    assert elapsed < 2.0
    assert info.value.headline == "interrupted ranks 0-1"
    assert {e.ename for e in info.value.errors.values()} == {"KeyboardInterrupt"}
    # The cluster and the namespaces survive.
    assert all(n > 0 for n in clean.run("n").values())


class _SleepOnLoad:
    """Unpickles (to None) by sleeping ``seconds``: a request that a rank has taken but whose
    code has not started yet."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        return time.sleep, (self.seconds,)


def test_interrupt_before_the_code_starts_is_not_lost(clean):
    """Ctrl-C while the ranks are still preparing a request (its arguments take 2 s to load)
    interrupts it as it starts; it does not run to the end as if never interrupted."""
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    with pytest.raises(CellError) as info:
        clean.call(lambda engine, _: "ran", _SleepOnLoad(2.0))
    assert info.value.headline == "interrupted ranks 0-1"
    assert {e.ename for e in info.value.errors.values()} == {"KeyboardInterrupt"}
    assert clean.run("rank").values() == [0, 1]


def test_timeout_interrupts_and_names_the_ranks(clean):
    with pytest.raises(CellTimeout) as info:
        clean.run("import time\nif rank == 1:\n    while True: pass\n'quick'", timeout=1)
    err = info.value
    assert "rank 1 was still running" in err.headline
    assert err.results.to_dict() == {0: "quick"}
    assert clean.run("rank").values() == [0, 1]


@pytest.mark.parametrize(
    ("timeout", "error", "says"),
    [
        (-1, ValueError, "timeout must be more than 0 seconds, or None for no limit; got -1"),
        (0, ValueError, "got 0"),
        (float("nan"), ValueError, "got nan"),
        ("3", TypeError, "timeout must be a number of seconds, or None for no limit; got '3'"),
        (True, TypeError, "got True"),
    ],
)
def test_a_timeout_that_cannot_be_kept_is_refused_before_anything_is_sent(
    clean, timeout, error, says
):
    # A timeout in the past used to be ignored: the cell ran without one.
    for block in (True, False):
        with pytest.raises(error) as info:
            clean.run("ran = True", timeout=timeout, block=block)
        assert says in str(info.value)
    assert clean.run("'ran' in globals()").values() == [False, False]


def test_an_interrupt_of_idle_ranks_spares_the_cell_sent_right_after(clean):
    # The interrupt travels on the control comm, the cell on the data path, which is faster:
    # the cell must not be taken for what ran when the interrupt was asked for.
    for _ in range(10):
        assert clean.interrupt() == [0, 1]
        assert clean.run("import time\ntime.sleep(0.05)\nrank").values() == [0, 1]


def test_noblock_handle(clean, capsys):
    handle = clean.run("import time\ntime.sleep(0.5)\nprint('finished')\nrank", block=False)
    assert not handle.done()
    assert "running" in repr(handle)
    assert handle.result(timeout=30).values() == [0, 1]
    assert handle.done() and handle.wait(0)
    time.sleep(0.3)
    assert "[ranks 0-1] finished" in capsys.readouterr().out


def test_noblock_interrupt_and_a_blocking_cell_waits_for_busy_ranks(clean, capsys):
    handle = clean.run("while True: pass", block=False)
    threading.Timer(1.0, handle.interrupt).start()
    assert clean.run("'after'").values() == ["after", "after"]
    assert "ranks 0-1 are busy with an earlier cell; this cell waits" in capsys.readouterr().err
    with pytest.raises(CellError, match="KeyboardInterrupt"):
        handle.result(timeout=10)
    handle = clean.run("import time\ntime.sleep(0.5)", block=False, targets=1)
    clean.push({"late": 1})  # a push queues behind the cell as a cell would, and says so
    assert "rank 1 is busy with an earlier cell; this push waits" in capsys.readouterr().err
    handle.result(timeout=10)
    handle = clean.run("import time\ntime.sleep(0.5)", block=False, targets=1)
    clean.scatter("part", [1, 2])  # named as asked, not as the push it is made of
    assert "rank 1 is busy with an earlier cell; this scatter waits" in capsys.readouterr().err
    handle.result(timeout=10)


def test_a_request_queued_behind_a_noblock_cell_is_cancelled_not_stuck(clean):
    """Interrupted (here by its timeout) while an earlier --noblock cell still runs, a cell
    that never started is reported as cancelled, not as stuck in a C call; it never runs."""
    handle = clean.run(
        "import time\nend = time.time() + 30\nwhile time.time() < end: pass", block=False
    )
    try:
        with pytest.raises(CellTimeout) as info:
            clean.run("ran = 1", timeout=0.5)
        for err in info.value.errors.values():
            assert err.ename == "Cancelled"
            assert "queued behind an earlier cell that is still running" in err.evalue
    finally:
        handle.interrupt()
    with pytest.raises(CellError, match="KeyboardInterrupt"):
        handle.result(timeout=10)
    assert clean.run("'ran' in globals()").values() == [False, False]


def test_heartbeats_flow_during_a_busy_cell(clean):
    def last_seen(dask_scheduler):
        return {ws.name: ws.last_seen for ws in dask_scheduler.workers.values()}

    handle = clean.run(
        "import time\nend = time.time() + 3\nwhile time.time() < end: pass", block=False
    )
    first = clean.client.run_on_scheduler(last_seen)
    time.sleep(2.5)  # a worker heartbeats every second (Dask's heartbeat_interval)
    later = clean.client.run_on_scheduler(last_seen)
    handle.result(timeout=30)
    assert set(later) == {0, 1}
    assert all(later[name] > first[name] for name in later)


def test_status_reset_interrupt_of_idle_ranks(clean):
    clean.run("a = 1\nb = 2\n_private = 3")
    rows = clean.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["state"] == "idle" and r["names"] == 2 and r["pid"] for r in rows)
    assert rows[0]["device"]["kind"] == "cpu"
    assert clean.interrupt() == [0, 1]
    assert clean.reset("0") == [0]
    with pytest.raises(NameError, match="a is not defined on rank 0"):
        clean.pull("a")
    assert clean.pull("a", targets=1).values() == [1]


def test_restart_gives_fresh_processes_with_the_same_ranks(clean):
    pids = [r["pid"] for r in clean.status()]
    clean.run("kept = 1")
    clean.restart()
    assert [r["pid"] for r in clean.status()] != pids
    assert [i.rank for i in clean.ranks] == [0, 1]
    assert clean.run("(rank, 'kept' in globals())").values() == [(0, False), (1, False)]
    # The process group is formed again over the fresh processes.
    code = (
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert clean.run(code).values() == [2.0, 2.0]


def test_up_while_up_is_refused(clean):
    with pytest.raises(monarch_nb.ClusterError, match="already up"):
        monarch_nb.up(workers=1, cpu=True)


def test_bad_targets(clean):
    with pytest.raises(monarch_nb.TargetError, match="rank 2 is out of range"):
        clean.run("1", targets="2")


def test_code_stuck_in_a_c_call_is_reported_with_restart_offered(clean):
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    with pytest.raises(CellError) as info:
        clean.run("import time\ntime.sleep(4 if rank == 0 else 0)\nrank")
    err = info.value
    assert err.headline == "rank 0 does not stop and still runs"  # nothing else was running
    assert err.errors[0].ename == "StillRunning"
    assert "%monarch restart" in err.errors[0].evalue
    assert err.results.to_dict() == {1: 1}
    assert clean.run("'usable'", targets=0).values() == ["usable"]  # waits for the sleep to end


# -- worker processes that start processes of their own -----------------------------------------
DATALOADER = (
    "from torch.utils.data import DataLoader\n"
    "[b.tolist() for b in DataLoader(list(range(4)), batch_size=2, num_workers=2)]"
)
# an iterator kept in the namespace keeps its DataLoader's processes running
KEEP_ITERATOR = (
    "from torch.utils.data import DataLoader\nit = iter(DataLoader(range(8), num_workers=2))"
)


def test_a_cell_can_start_a_dataloader_with_workers(cell, clean):
    import dask

    assert cell(f"%%monarch\n{DATALOADER}").values() == [[[0, 1], [2, 3]]] * 2
    # the workers are not daemons, and the notebook's own Dask config is left as it was
    assert dask.config.get("distributed.worker.daemon") is True


def test_down_leaves_no_worker_or_dataloader_process_behind(no_current):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    ctl.run(KEEP_ITERATOR)
    ctl.restart()  # the fresh workers are not daemons either
    ctl.run(KEEP_ITERATOR)
    assert ctl.run("next(it).tolist()").values() == [[0], [0]]
    ours = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert len(ours) >= 6  # two workers, each with two DataLoader processes
    ctl.down()
    assert wait_for(lambda: not running(ours), timeout=30), running(ours)


EXIT_WITHOUT_DOWN = f"""
import json, multiprocessing, psutil, monarch_nb
if __name__ == "__main__":
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    ctl.run({KEEP_ITERATOR!r})
    multiprocessing.get_logger()  # moves multiprocessing's exit handler ahead of Dask's
    print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]))
"""


def test_an_interpreter_that_exits_without_down_takes_its_workers_with_it(tmp_path):
    # multiprocessing joins non-daemon children at exit: the cluster must be closed before.
    script = tmp_path / "exit_without_down.py"
    script.write_text(EXIT_WITHOUT_DOWN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) >= 6
    assert wait_for(lambda: not running(pids), timeout=10), running(pids)


@pytest.mark.parametrize("name", ["1bad", "a-b", "for"])
def test_out_refuses_a_name_python_cannot_use(cell, clean, name):
    from IPython.core.error import UsageError

    cell(f"%%monarch --out {name}\nrank", expect_error=True)
    assert isinstance(cell.error, UsageError)
    assert str(cell.error) == f"--out takes a Python name to store the result as, got {name!r}"
    assert name not in cell.shell.user_ns
