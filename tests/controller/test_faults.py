"""Real processes that fail: a worker killed mid-cell, the scheduler killed, the controlling
kernel killed or restarted, and interrupts of a collective, an output flood and a background
cell. Nothing may hang, and the cluster must be usable (or cleanly gone) afterwards."""

from __future__ import annotations

import _thread
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import _actor_helpers as actor_helpers
import cloudpickle
import pytest
from _kernel import KernelProcess
from _wait import running, wait_for

import monarch_nb
from monarch_nb import CellError, CellTimeout, ClusterError, registry
from monarch_nb import errors as module
from monarch_nb.actors import mesh as actors

cloudpickle.register_pickle_by_value(actor_helpers)

ALL_REDUCE = (
    "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
)


@pytest.fixture
def own():
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    yield ctl
    ctl.down()


# -- a worker killed in the middle of a cell ----------------------------------------------------
def test_sigkill_mid_cell_names_the_rank_and_the_replacement_takes_it(own):
    pid = own.run("import os\nos.getpid()", targets=1).item()
    own.run("kept = 'rank 0 value'")
    handle = own.run(
        "import time\nstart = time.time()\n"
        "while rank == 1 and time.time() - start < 30: pass\nrank * 10",
        block=False,
    )
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CellError) as info:
        handle.result(timeout=10)
    assert info.value.results.to_dict() == {0: 0}  # the other rank's result is kept
    assert set(info.value.errors) == {1}
    err = info.value.errors[1]
    assert err.ename == "WorkerLost" and "connection closed" in err.evalue
    assert "[rank 1 on " in err._render_traceback_()[0]
    notices: list[str] = []
    assert wait_for(
        lambda: (
            notices.extend(own.notices())
            or any("process group was formed again" in n for n in notices)
        )
    )
    assert any("rank 1 on" in n and "lost its worker" in n for n in notices)
    assert any("what the old one held is lost" in n for n in notices)
    mesh = own.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t)\n(t.item(), 'kept' in globals())"
    )
    assert mesh.values() == [(2.0, True), (2.0, False)]
    assert own.run("import os\nos.getpid()", targets=1).item() != pid


def test_a_cell_waits_for_a_replacement_attached_but_not_yet_set_up(clean, capsys):
    # between a replacement's attaching and its --setup cells' running again (attach.py), a
    # cell would find there none of what they define: it waits for them instead
    clean.setting_up.add(1)
    threading.Timer(1.0, clean.setting_up.discard, [1]).start()
    start = time.monotonic()
    assert clean.run("rank").values() == [0, 1]
    assert time.monotonic() - start >= 1.0
    assert "waiting for rank 1 to be set up as a replacement first" in capsys.readouterr().err


# -- the scheduler killed -----------------------------------------------------------------------
@pytest.fixture
def outside_cluster(tmp_path):
    """A scheduler and two workers in processes of their own, as on a real allocation."""
    yield from _outside_cluster(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fixed_ports_cluster(tmp_path):
    """The same with each worker on a port of its own: its nanny restarts it there."""
    yield from _outside_cluster(tmp_path, worker_ports=(_free_port(), _free_port()))


def _outside_cluster(tmp_path, worker_ports=(None, None)):
    path = tmp_path / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = subprocess.Popen(
        [
            *(sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"),
            *("--port", "0", "--no-dashboard", "--scheduler-file", str(path)),
        ],
        **quiet,
    )
    procs = [scheduler]
    try:
        assert wait_for(path.exists, timeout=30), "the scheduler did not start"
        for name, port in zip(("0", "1"), worker_ports, strict=True):
            fixed = ("--worker-port", str(port)) if port else ()
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "distributed.cli.dask_worker"),
                        *("--scheduler-file", str(path), "--name", name, "--nthreads", "1"),
                        *("--no-dashboard", "--host", "127.0.0.1", *fixed),
                    ],
                    **quiet,
                )
            )
        yield path, scheduler
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def kill_scheduler(cell, outside_cluster):
    path, scheduler = outside_cluster
    cell(f"%monarch connect --scheduler-file {path} --workers 2 --no-dist")
    ctl = module.current()
    assert ctl.run("rank").values() == [0, 1]
    scheduler.send_signal(signal.SIGKILL)
    scheduler.wait()
    return ctl, time.monotonic()


def test_scheduler_killed_is_noticed_and_down_and_up_work_afterwards(
    cell, no_current, outside_cluster
):
    ctl, _ = kill_scheduler(cell, outside_cluster)
    assert wait_for(lambda: ctl.client.status != "running", timeout=30)
    cell("%%monarch\nrank", expect_error=True)
    assert "is gone" in str(cell.error) and "%monarch down" in str(cell.error)
    cell("%monarch down")
    assert module.current() is None
    cell("%monarch up --workers 1 --cpu --no-dist")
    assert cell("%%monarch\nrank").values() == [0]
    cell("%monarch down")
    assert "cluster shut down" in cell.out


def test_scheduler_killed_is_named_as_the_cause(cell, no_current, outside_cluster):
    ctl, killed = kill_scheduler(cell, outside_cluster)
    address = ctl.scheduler_address
    notices: list[str] = []
    assert wait_for(
        lambda: notices.extend(ctl.notices()) or any("scheduler" in n for n in notices),
        timeout=10,
    ), notices
    assert any(address in n for n in notices if "scheduler" in n)
    assert time.monotonic() - killed < 10
    with pytest.raises(ClusterError, match=r"scheduler .* is gone"):
        ctl.run("rank")


def test_workers_back_at_the_same_address_are_new_processes_to_cells_and_actors(
    no_current, fixed_ports_cluster
):
    """A restart, then a killed worker, with fixed worker ports: the new processes are attached
    and spawned on, and actors on the old ones stay dead, saying why."""
    path, _ = fixed_ports_cluster
    ctl = monarch_nb.connect(scheduler_file=str(path), workers=2, dist=False)
    addresses = [info.address for info in ctl.ranks]
    old = actors.proc_mesh().spawn("old", actor_helpers.Counter)
    ctl.restart()
    assert [info.address for info in ctl.ranks] == addresses
    with pytest.raises(actors.SupervisionError, match=r"rank 0 is dead: the workers were restar"):
        old.incr.call().get(timeout=10)
    counters = actors.proc_mesh().spawn("counters", actor_helpers.Counter)
    assert counters.incr.call().get(timeout=10).values() == [1, 1]
    assert actors.dead_actors() == []  # the meshes from before the restart are forgotten

    pid = ctl.run("import os\nos.getpid()", targets=1).item()
    os.kill(pid, signal.SIGKILL)
    notices: list[str] = []
    assert wait_for(
        lambda: (
            notices.extend(ctl.notices()) or any("replacement worker took" in n for n in notices)
        ),
        timeout=30,
    ), notices
    assert [info.address for info in ctl.ranks] == addresses
    assert ctl.run("rank").values() == [0, 1]  # the replacement at the old address is attached
    lost = [f.exception(timeout=10) for f in counters.incr.stream()]
    assert lost[1] is None and "rank 1 is dead" in str(lost[0])
    assert {counters.incr.choose().get(timeout=10) for _ in range(3)} == {3, 4, 5}  # rank 0
    again = actors.proc_mesh().spawn("again", actor_helpers.Counter)
    assert again.incr.call().get(timeout=10).values() == [1, 1]
    assert [name for name, _, _ in actors.dead_actors()] == ["counters"]
    ctl.down()


# -- an interrupted up ----------------------------------------------------------------------------
@pytest.mark.parametrize("after", [0.3, 0.7])
def test_an_interrupted_up_stops_the_workers_it_was_starting(no_current, after):
    import psutil

    def workers() -> set[int]:
        pids = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if "resource_tracker" not in " ".join(p.cmdline()):
                    pids.add(p.pid)
            except psutil.Error:  # gone, or a zombie that its parent (the forkserver) reaps
                pass
        return pids

    before = workers()
    threading.Timer(after, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt, match="up interrupted; its workers were stopped"):
        monarch_nb.up(workers=2, cpu=True, dist=False)
        time.sleep(30)  # up finished first: the interrupt lands here, without that message
    assert module.current() is None
    assert wait_for(lambda: workers() <= before, timeout=10), workers() - before


def test_an_interrupted_down_finishes_going_down_and_says_so(no_current):
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
    close = ctl.client.close

    def close_then_interrupted(*args, **kwargs):  # Ctrl-C landing while the client closes
        close(*args, **kwargs)
        raise KeyboardInterrupt

    ctl.client.close = close_then_interrupted
    with pytest.raises(KeyboardInterrupt) as info:
        ctl.down()
    ctl.client.close = close  # Client.__del__ closes it again
    assert str(info.value).endswith("down was interrupted; the cluster was shut down all the same")
    assert info.value._render_traceback_() == [f"KeyboardInterrupt: {info.value}"]
    assert ctl.cluster.status.name == "closed" and module.current() is None


def test_interrupted_waits_and_commands_say_what_became_of_them_in_one_line(cell, clean):
    handle = clean.run("import time\ntime.sleep(3)", block=False)
    interrupt_after(0.5)
    with pytest.raises(KeyboardInterrupt, match="stopped waiting for the cell; it goes on running"):
        handle.result()
    assert handle.result(timeout=10).values() == [None, None]  # it did go on
    interrupt_after(0.5)
    cell("%monarch push x=__import__('time').sleep(5)", expect_error=True)
    assert cell.error._render_traceback_() == ["KeyboardInterrupt: %monarch push was interrupted"]


# -- the controlling kernel killed or restarted -------------------------------------------------
class Kernel(KernelProcess):
    """The kernel the fault tests restart, kill and start clusters in."""

    def restart(self):
        """What the restart button does: a graceful shutdown, then a fresh kernel process on
        the same connection file (so the same client keeps working)."""
        self.km.restart_kernel(now=False)
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str) -> str:
        texts: list[str] = []

        def keep(msg):
            content = msg["content"]
            if msg["msg_type"] == "stream":
                texts.append(content["text"])
            elif msg["msg_type"] == "error":
                texts.append("\n".join(content["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=120, output_hook=keep)
        out = "".join(texts)
        assert reply["content"]["status"] == "ok", out
        return out

    def up(self) -> tuple[int, list[int], str]:
        """Start a cluster in the kernel: (kernel pid, its cluster's process pids, cluster id)."""
        self.run("%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist")
        out = self.run(
            "import json, os, psutil, monarch_nb\n"
            "print(json.dumps([os.getpid(), monarch_nb.current().id,"
            " [p.pid for p in psutil.Process().children(recursive=True)]]))"
        )
        pid, cluster_id, children = json.loads(out.strip().splitlines()[-1])
        return pid, children, cluster_id


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A real kernel whose Jupyter runtime directory (and so cluster registry) is the test's."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    k = Kernel(runtime)
    k.runtime = runtime
    try:
        yield k
    finally:
        k.close()


def test_killed_or_restarted_kernel_takes_its_cluster_and_registry_entry_with_it(kernel):
    for how in ("restart", "kill"):
        pid, children, cluster_id = kernel.up()
        assert len(children) >= 2  # the two worker processes (and multiprocessing's helper)
        assert cluster_id in {e["id"] for e in registry.list_entries()}
        if how == "restart":
            kernel.restart()
        else:
            os.kill(pid, signal.SIGKILL)  # left a zombie: nothing here reaps it
        cluster = [pid, *children]
        assert wait_for(lambda c=cluster: not running(c), timeout=30), (how, running(cluster))
        assert cluster_id not in {e["id"] for e in registry.list_entries(prune=True)}, how
        assert not (kernel.runtime / registry.DIRNAME / f"{cluster_id}.json").exists()


def test_the_kernels_interrupt_stops_the_cell_and_leaves_the_workers_running(kernel):
    _, children, _ = kernel.up()
    msg_id = kernel.kc.execute("%%monarch\nimport time\nfor _ in range(300):\n    time.sleep(0.1)")
    time.sleep(2)  # the cell runs on the ranks
    # JupyterLab's stop button: SIGINT to the kernel's whole process group.
    kernel.km.interrupt_kernel()
    reply = kernel.interrupted(msg_id)
    assert reply["content"]["status"] == "error"
    assert "interrupted" in reply["content"]["evalue"]
    out = kernel.run("%%monarch\nprint('alive', rank)")
    assert "[rank 0] alive 0" in out and "[rank 1] alive 1" in out
    assert len(running(children)) == len(children)  # no worker was lost or replaced


def test_an_interrupted_restart_leaves_workers_the_next_cell_attaches_to(kernel):
    # spawned workers: forked from the forkserver, a restart may be over within 0.5 s
    kernel.run("import os; os.environ['MONARCH_NB_FORKSERVER'] = '0'")
    kernel.up()
    msg_id = kernel.kc.execute("%monarch restart")
    time.sleep(0.5)  # the old workers are going, the new ones starting
    kernel.km.interrupt_kernel()
    reply = kernel.interrupted(msg_id, timeout=60)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert "the next cell attaches to the new ones" in reply["content"]["evalue"]
    time.sleep(3)
    kernel.km.interrupt_kernel()  # the new workers left the kernel's group as they started
    time.sleep(0.5)
    out = kernel.run("%%monarch\nprint('alive', rank)")
    assert "attaching to the restarted workers" in out
    assert "[rank 0] alive 0" in out and "[rank 1] alive 1" in out
    assert "[rank 1] alive 1" in kernel.run("%%monarch\nprint('alive', rank)")


def test_workers_start_with_sigint_blocked_and_the_processes_cells_start_get_it(clean):
    """The stop button's SIGINT cannot reach a worker still starting in the kernel's process
    group (its traceback went into the cell): workers start with SIGINT blocked, and the
    engine's thread unblocks it, so a process a cell starts can still be interrupted."""
    pid, child = clean.run(
        "import os, subprocess\n"
        "(os.getpid(), subprocess.run(['grep', 'SigBlk', '/proc/self/status'],"
        " capture_output=True, text=True).stdout)",
        targets=0,
    ).item()
    with open(f"/proc/{pid}/status") as f:  # the worker's main thread
        worker = next(line for line in f if line.startswith("SigBlk"))
    sigint = 1 << (signal.SIGINT - 1)
    assert int(worker.split()[1], 16) & sigint
    assert not int(child.split()[1], 16) & sigint


START_CHILDREN = (
    "%%monarch\nimport json, subprocess\n"
    "held = subprocess.Popen(['sleep', '300'])\n"
    "loose = subprocess.check_output(['sh', '-c', 'sleep 301 > /dev/null 2>&1 & echo $!'])\n"
    "print(json.dumps([held.pid, int(loose)]))"
)


def started(out: str) -> list[int]:
    return [pid for line in out.splitlines() if "[" in line for pid in json.loads(line[9:])]


def test_what_cells_start_goes_with_their_workers(kernel):
    """A cell's subprocess, and one its shell left in the background, end with the worker:
    at %monarch restart, %monarch down and when the kernel is killed."""
    kernel.up()
    for step in ("%monarch restart", "%monarch down", "kill"):
        children = started(kernel.run(START_CHILDREN))
        assert len(children) == 4 and len(running(children)) == 4
        if step == "kill":
            kernel.km.restart_kernel(now=True)  # SIGKILL, as a stuck kernel's restart
            kernel.kc.wait_for_ready(timeout=60)
        else:
            kernel.run(step)
        gone = wait_for(lambda c=children: not running(c), timeout=15)
        assert gone, (step, running(children))
        if step == "%monarch down":
            kernel.run("%monarch up --workers 2 --cpu --no-dist")


BROKEN_ACTOR = """
from monarch_nb import Actor, endpoint, proc_mesh

class Broken(Actor):
    @endpoint
    def fail(self):
        raise RuntimeError("endpoint boom")

broken = proc_mesh().spawn("broken", Broken)
"""


def test_a_failed_broadcast_is_shown_under_the_cell_that_runs_when_it_fails(kernel):
    """ipykernel 7 files a thread's output under the cell the thread's context came from; the
    failure of a broadcast sent later belongs to the cell running then."""
    kernel.up()
    kernel.run(BROKEN_ACTOR)
    out = kernel.run("import time\nbroken.fail.broadcast()\ntime.sleep(2)")
    assert "broadcast to Broken.fail failed on rank 0: RuntimeError: endpoint boom" in out


# -- interrupts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("apart", [0.05, 0.1])
def test_two_quick_presses_report_the_interrupted_ranks_as_interrupted(clean, apart):
    """The second press stops the waiting; the ranks are neither 'cancelled before they
    started' nor 'stuck in a C call': they were interrupted."""
    ended = threading.Event()

    def press():  # a press after the cell returned would land in the test, not the cell
        if not ended.is_set():
            _thread.interrupt_main()

    timers = [threading.Timer(t, press) for t in (1.0, 1.0 + apart)]
    for timer in timers:
        timer.start()
    with pytest.raises(CellError) as info:
        try:
            clean.run("import time\nfor _ in range(300):\n    time.sleep(0.1)")
        finally:
            ended.set()
    for timer in timers:
        timer.join()
    assert {e.ename for e in info.value.errors.values()} == {"KeyboardInterrupt"}, [
        f"{e.ename}: {e.evalue}" for e in info.value.errors.values()
    ]
    assert clean.run("'next'").values() == ["next", "next"]


def test_an_interrupt_stops_a_subprocess_the_cell_waits_on(clean, tmp_path):
    """As the stop button does in plain Jupyter: SIGINT reaches the worker's process group."""
    code = (
        "import subprocess\n"
        f"script = 'echo $$ > {tmp_path}/' + str(rank) + '; exec sleep 30'\n"
        "subprocess.run(['sh', '-c', script])"
    )
    start = time.monotonic()
    with pytest.raises(CellTimeout):
        clean.run(code, timeout=1.5)
    assert clean.run("'next'").values() == ["next", "next"]
    assert time.monotonic() - start < 10  # not the 30 s the sleeps would have taken
    pids = [int((tmp_path / str(r)).read_text()) for r in (0, 1)]
    assert wait_for(lambda: not running(pids), timeout=5), running(pids)


def interrupt_after(seconds: float) -> None:
    threading.Timer(seconds, _thread.interrupt_main).start()


def test_interrupt_during_a_collective_sets_the_waiting_rank_free_and_forms_the_group(cell, clean):
    interrupt_after(1.0)
    start = time.monotonic()
    cell(
        "%%monarch\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "if rank == 0:\n    dist.all_reduce(t)  # rank 1 never joins\nrank",
        expect_error=True,
    )
    assert time.monotonic() - start < 6  # control comes back: 1 s + the interrupt's grace
    err = cell.error
    assert isinstance(err, CellError) and err.headline == "interrupted rank 0"
    assert err.errors[0].ename == "KeyboardInterrupt"  # no longer blocked in gloo's C code
    assert "waited in a collective the other ranks had left" in err.errors[0].evalue
    assert err.results.to_dict() == {1: 1}
    assert "the gloo process group was formed again" in cell.err
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]
    cell("%monarch restart")
    assert "restarted ranks 0-1" in cell.out
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]


def test_a_rank_held_in_a_collective_is_set_free_though_a_model_holds_the_group(cell, clean):
    # leaving the group frees nothing while a model holds it: its connections are cut instead
    interrupt_after(1.0)
    start = time.monotonic()
    cell(
        "%%monarch\nimport torch, torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d\n"
        "held = distributed_c10d._get_default_group()  # as a DDP model holds it\n"
        "t = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)  # rank 1 never joins\nrank",
        expect_error=True,
    )
    assert time.monotonic() - start < 10  # not the group's timeout, 30 s
    assert cell.error.errors[0].ename == "KeyboardInterrupt"
    assert "waited in a collective the other ranks had left" in cell.error.errors[0].evalue
    assert "the gloo process group was formed again" in cell.err
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]


def test_a_noblock_cell_left_out_of_step_gets_the_group_formed_before_the_next_cell(cell, clean):
    handle = clean.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "if rank == 0:\n    dist.all_reduce(t, async_op=True)  # queued; rank 1 never joins\n"
        "while True:\n    pass",
        block=False,
    )
    time.sleep(1.0)
    handle.interrupt()
    with pytest.raises(CellError):
        handle.result(timeout=10)
    assert clean.regroup_pending  # the handle's thread leaves it to the next cell
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]
    assert "out of step; the gloo process group was formed again" in cell.err
    assert not clean.regroup_pending


def test_ranks_interrupted_at_different_collectives_get_the_group_formed_again(cell, clean):
    interrupt_after(1.0)
    cell(
        "%%monarch\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "if rank == 0:\n    dist.all_reduce(t, async_op=True)  # queued; rank 1 never joins\n"
        "while True:\n    pass",
        expect_error=True,
    )
    assert {e.ename for e in cell.error.errors.values()} == {"KeyboardInterrupt"}
    done = re.search(r"collectives done: rank 0: (\d+), rank 1: (\d+)", cell.err)
    assert done and int(done[1]) == int(done[2]) + 1, cell.err
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]  # they would pair wrongly
    interrupt_after(1.0)
    cell("%%monarch\nwhile True:\n    pass", expect_error=True)
    assert "formed again" not in cell.err, cell.err  # in step: left as it was


# The flood ends by itself after 6 s, so a lost interrupt shows as a failure, not a hang.
FLOOD = (
    "%%monarch --no-collapse\nimport time\ni, end = 0, time.time() + 6\n"
    "while time.time() < end:\n    i += 1\n    print('flood', rank, i)"
)


def press_stop(times: int = 4, every: float = 1.0) -> list[threading.Timer]:
    """Ctrl-C after 1 s, and again each second (as a user would) until ``times`` presses."""
    timers = [threading.Timer(k * every, _thread.interrupt_main) for k in range(1, times + 1)]
    for timer in timers:
        timer.start()
    return timers


def flood_numbers(out: str, rank: int) -> list[int]:
    """The numbers a rank printed, in order; its last line may be cut where the interrupt hit
    print() between its pieces (that partial line is shown as printed, and skipped here)."""
    prefix = f"[rank {rank}] flood {rank}"
    rests = [ln[len(prefix) :].strip() for ln in out.splitlines() if ln.startswith(prefix)]
    if rests and not rests[-1].isdigit():
        rests.pop()
    return [int(r) for r in rests]


def test_interrupt_during_an_output_flood_loses_nothing(cell, clean):
    # One press: a second one during the grace period would (by design) stop waiting for the
    # ranks to flush their backlog, and what they print after that is not shown.
    timers = press_stop(times=1)
    start = time.monotonic()
    try:
        cell(FLOOD, expect_error=True)
    finally:
        for timer in timers:
            timer.cancel()
    assert time.monotonic() - start < 6  # control came back before the flood's own end
    assert cell.error.headline == "interrupted ranks 0-1", cell.error
    assert {e.ename for e in cell.error.errors.values()} == {"KeyboardInterrupt"}
    for rank in (0, 1):
        numbers = flood_numbers(cell.out, rank)
        assert numbers == list(range(1, len(numbers) + 1))  # in order, none missing
    start = time.monotonic()
    assert cell("%%monarch\nrank").values() == [0, 1]
    assert time.monotonic() - start < 5
    assert all(n > 0 for n in cell("%%monarch\ni").values())


# After the interrupt each rank prints for 3 s more, never silent for longer than 0.3 s.
CLEANUP = (
    "%%monarch --no-collapse\nimport time\ntry:\n    while True:\n        time.sleep(0.01)\n"
    "except KeyboardInterrupt:\n    for i in range(10):\n        print('cleanup', rank, i)\n"
    "        time.sleep(0.3)\n    raise"
)


def test_interrupt_hears_out_ranks_still_printing(cell, clean):
    """A rank that keeps printing after the interrupt (its cleanup, or a backlog on a busy
    machine) is not reported stuck while its output arrives, and none of it is lost."""
    timers = press_stop(times=1)
    try:
        cell(CLEANUP, expect_error=True)
    finally:
        for timer in timers:
            timer.cancel()
    assert cell.error.headline == "interrupted ranks 0-1", cell.error
    assert {e.ename for e in cell.error.errors.values()} == {"KeyboardInterrupt"}
    for rank in (0, 1):
        lines = [ln for ln in cell.out.splitlines() if ln.startswith(f"[rank {rank}] cleanup")]
        assert lines == [f"[rank {rank}] cleanup {rank} {i}" for i in range(10)]


def test_interrupt_of_a_noblock_cell(cell, clean):
    for how in ("handle", "magic"):
        handle = cell("%%monarch --noblock\nwhile True: pass")
        time.sleep(0.5)
        assert not handle.done()
        if how == "handle":
            handle.interrupt()
        else:
            cell("%monarch interrupt")
        with pytest.raises(CellError, match="KeyboardInterrupt") as info:
            handle.result(timeout=5)
        assert set(info.value.errors) == {0, 1}
        assert cell("%%monarch\nrank").values() == [0, 1]


def test_dask_logs_of_a_local_cluster_stay_out_of_the_notebook(no_current, monkeypatch):
    """Where the notebook configured logging first (no handler of Dask's own), the in-process
    scheduler's and nannies' INFO lines, and the nanny's warning on a restart, are not shown."""
    distributed_logger = logging.getLogger("distributed")
    monkeypatch.setattr(distributed_logger, "handlers", [])
    monkeypatch.setattr(distributed_logger, "level", logging.NOTSET)
    monkeypatch.setattr(distributed_logger, "propagate", True)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.INFO)
    root.addHandler(handler)
    try:
        ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
        ctl.restart()
        # a worker that dies: the controller's notice says so, the nanny's warning is not shown
        os.kill(ctl.run("import os\nos.getpid()").item(), signal.SIGKILL)
        assert wait_for(lambda: any("replacement worker" in n for n in ctl.notices()))
        ctl.down()
    finally:
        root.removeHandler(handler)
    dask_lines = [r.getMessage() for r in seen if r.name.startswith("distributed")]
    assert dask_lines == []


def test_a_background_cell_cut_short_by_down_says_so(no_current):
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
    handle = ctl.run("import time\ntime.sleep(10)", block=False)
    time.sleep(0.5)
    ctl.down()
    with pytest.raises(CellError) as info:
        handle.result(timeout=20)
    assert info.value.errors[0].evalue.endswith(
        "the cluster was shut down (%monarch down) while the cell ran"
    )  # not the advice to restart that a worker lost on its own gets
