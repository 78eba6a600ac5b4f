"""Fault-tolerant training (``%monarch up --ft``, ``monarch_nb.ft``): a loop that goes on through
a lost rank, whose replacement heals from a live peer; and each fault's one line."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import psutil
import pytest
from _kernel import CellKernel
from _wait import wait_for

import monarch_nb
from monarch_nb import kept
from monarch_nb.dispatch.results import CellError
from monarch_nb.errors import ClusterError

os.environ.setdefault("RUST_LOG", "warn")  # read as torchft is imported: see lighthouse.py
pytest.importorskip("torchft")

SETUP = """\
import os, time, torch
from monarch_nb import ft
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
setup_pid = os.getpid()
"""
# A loop of {steps} steps that prints once it reaches step {mark}; its value says which process
# ran it and whether that one ran the --setup cell.
TRAIN = """\
model, opt = ft.wrap(model, opt)
for step in ft.steps({steps}):
    opt.zero_grad()
    model(torch.ones(4, 8)).square().mean().backward()
    opt.step()
    if step == {mark}:
        print("reached", step, flush=True)
    time.sleep({pause})
(ft.manager().current_step() - 1, os.getpid(), setup_pid == os.getpid())
"""


def train(steps=300, mark=-1, pause=0.02) -> str:
    return TRAIN.format(steps=steps, mark=mark, pause=pause)


# -- the whole path, through a real kernel ---------------------------------------------------
@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    k = CellKernel(tmp_path)
    try:
        yield k
    finally:
        k.close()


def text(msgs: list[dict]) -> str:
    parts = []
    for m in msgs:
        content = m["content"]
        if m["msg_type"] == "stream":
            parts.append(content["text"])
        elif "data" in content:
            parts.append(content["data"].get("text/plain", ""))
        elif m["msg_type"] == "error":
            parts.append("\n".join(content["traceback"]))
    return "".join(parts)


def test_a_sigkilled_rank_mid_loop_is_replaced_set_up_healed_and_finishes_with_the_others(kernel):
    started = text(kernel.run("%load_ext monarch_nb\n%monarch up --workers 3 --cpu --ft"))
    assert "torchft: Lighthouse at http" in started
    kernel.run("%%monarch --setup\n" + SETUP)
    pids = text(kernel.run("%%monarch\nprint('pid', os.getpid())"))
    victim = int(re.search(r"\[rank 1\] pid (\d+)", pids).group(1))
    msg_id = kernel.start("%%monarch\n" + train(steps=150, mark=20))
    before = kernel.messages(msg_id, timeout=120, until=lambda m: "reached" in text([m]))
    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    after = kernel.messages(msg_id, timeout=120)
    assert kernel.kc.get_shell_msg(timeout=10)["content"]["status"] == "ok"
    out = text(before + after)
    assert re.search(r"\[rank 1\] rank 1 lost at step \d+; 2 of 3 go on", out), out
    assert re.search(r"\[rank 1\] rank 1 is back at step \d+, healed from a live peer", out), out
    values = dict(re.findall(r"(\d): \(149, \d+, (True|False)\)", out))
    # every rank ended at the last step, the replacement too, which ran the --setup cell itself
    assert values == {"0": "True", "1": "True", "2": "True"}, out
    assert f", {victim}, " not in out
    history = text(
        kernel.run("from monarch_nb import ft\n[(e['rank'], e['event']) for e in ft.history()]")
    )
    assert "[(1, 'lost'), (1, 'joining'), (1, 'healing'), (1, 'back')]" in history, history
    status = text(kernel.run("%monarch status"))
    assert re.search(r"torchft: quorum \d+ of ranks 0-2 \(3 participants\) at step 150", status)


# -- the faults, in this process -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ft_ctl(runtime):
    ctl = monarch_nb.up(workers=3, cpu=True, ft=True, current=False)
    ctl.run(SETUP, setup=True)
    yield ctl
    ctl.down()
    assert not ctl.ft.alive  # the Lighthouse goes with the cluster


def later(seconds: float, fn) -> None:
    threading.Timer(seconds, fn).start()


def when_step(ctl, step: int, fn) -> None:
    """``fn()`` from a thread once the ranks report ``step``."""

    def watch():
        wait_for(lambda: ctl.ft_quorum.get("step", -1) >= step, timeout=60, interval=0.02)
        fn()

    threading.Thread(target=watch, daemon=True).start()


def test_every_rank_killed_at_once_ends_the_cell_and_the_replacements_are_set_up(ft_ctl):
    start = len(ft_ctl.ft_events)
    ft_ctl.ft_quorum.clear()
    when_step(ft_ctl, 20, lambda: [ft_ctl.kill(r) for r in range(3)])
    with pytest.raises(CellError) as e:
        ft_ctl.run(train(), stream=False)
    # the last rank found lost ends the others' waits (which rank that is, and so whose
    # error heads the cell, is the order the kills are noticed in)
    ended = [err.evalue for err in e.value.errors.values()]
    assert any("no live peer to heal from" in why for why in ended), ended
    assert wait_for(lambda: all(i.alive for i in ft_ctl.ranks) and not ft_ctl.healing_ranks)
    # the next cell has the --setup cell's names on every replacement, and the group formed
    assert ft_ctl.run("setup_pid == os.getpid()", stream=False).values() == [True] * 3
    assert {e["event"] for e in ft_ctl.ft_events[start:]} <= {"lost"}


def test_a_rank_killed_while_it_rejoins_is_brought_back_in_its_turn(ft_ctl):
    def kill_twice():
        ft_ctl.kill(2)
        wait_for(lambda: ft_ctl.ft_events[-1]["event"] == "joining", interval=0.01)
        ft_ctl.kill(2)

    start = len(ft_ctl.ft_events)
    ft_ctl.ft_quorum.clear()
    when_step(ft_ctl, 20, kill_twice)
    result = ft_ctl.run(train(steps=200), stream=False)
    assert [v[0] for v in result.values()] == [199] * 3
    events = [(e["rank"], e["event"]) for e in ft_ctl.ft_events[start:]]
    assert events == [(2, "lost"), (2, "joining"), (2, "lost"), (2, "joining"), (2, "healing"),
                      (2, "back")]  # fmt: skip


def test_the_lighthouse_killed_releases_the_cell_at_once_and_the_next_cell_gets_a_new_one(
    ft_ctl, capsys
):
    old = ft_ctl.ft
    ft_ctl.ft_quorum.clear()
    when_step(ft_ctl, 20, lambda: os.kill(old.pid, signal.SIGKILL))
    with pytest.raises(CellError) as e:  # at once, not at the quorum's 30 s timeout
        ft_ctl.run(train(), stream=False)
    assert f"Released: torchft's Lighthouse (pid {old.pid}) exited" in str(e.value)
    capsys.readouterr()
    # the same loop again: a new Lighthouse, and the loop goes on from the step it reached
    result = ft_ctl.run(train(steps=60), stream=False)
    assert ft_ctl.ft is not old and ft_ctl.ft.alive
    assert f"Lighthouse (pid {old.pid}) had exited; a new one runs at" in capsys.readouterr().err
    assert [v[0] for v in result.values()] == [59] * 3 or min(v[0] for v in result.values()) >= 20


def test_ctrl_c_stops_every_rank_at_once_and_the_loop_goes_on_from_its_step(ft_ctl):
    ft_ctl.ft_quorum.clear()
    when_step(ft_ctl, 20, lambda: os.kill(os.getpid(), signal.SIGINT))  # the stop button
    with pytest.raises(CellError) as e:
        ft_ctl.run(train(steps=100_000), stream=False)
    # Every rank stops: within the grace where it was in Python or in one of torchft's gloo
    # collectives (the interrupt cuts them). A rank in another of torchft's calls in C stops
    # when that call returns (seen once in a loaded full run, after the Lighthouse test),
    # and the headline says so; the loop is there for the next cell either way.
    assert re.fullmatch(r"interrupted ranks? [0-9, -]+(; rank \d does not stop and still runs)?",
                        e.value.headline), e.value.headline  # fmt: skip
    assert wait_for(lambda: not ft_ctl._router.busy(), timeout=30)
    reached = ft_ctl.ft_quorum["step"]
    result = ft_ctl.run(train(steps=reached + 10, pause=0), stream=False)
    assert [v[0] for v in result.values()] == [reached + 9] * 3


def test_setup_cells_run_again_on_ranks_that_scale_adds(ft_ctl, capsys):
    ft_ctl.scale(4)
    try:
        assert "the 1 --setup cell ran again there" in " ".join(ft_ctl.notices())
        assert ft_ctl.run("setup_pid == os.getpid()", stream=False).values() == [True] * 4
    finally:
        ft_ctl.scale(3)


# -- bad input: one line each, the cluster as it was -------------------------------------------
def test_kill_of_a_rank_that_does_not_exist(ft_ctl):
    for bad in (3, -1, "1"):
        with pytest.raises(
            ClusterError, match=r"no rank .* to kill: this cluster's ranks are 0 to 2"
        ):
            ft_ctl.kill(bad)


def test_wrap_and_steps_refuse_what_cannot_work_in_one_line(ft_ctl, ctl):
    with pytest.raises(CellError, match="started without --ft"):
        ctl.run("import torch\nfrom monarch_nb import ft\nft.wrap(torch.nn.Linear(1, 1), None)")
    bad = {
        "ft.wrap(model, opt, min_replicas=4)": "min_replicas=4 is more than the 3 ranks",
        "fresh = torch.nn.Linear(2, 1)\n"
        "fresh, o = ft.wrap(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))\n"
        "for s in ft.steps(3): pass": "must call the wrapped optimizer's step()",
        "ft.steps(-1)": "whole number of steps",
    }
    for code, message in bad.items():
        with pytest.raises(CellError, match=re.escape(message)):
            ft_ctl.run(code)
    assert ft_ctl.run("1", stream=False).values() == [1] * 3


def test_ft_where_torchft_cannot_be_imported_says_how_to_install_it(monkeypatch, runtime):
    monkeypatch.setitem(sys.modules, "torchft._torchft", None)
    with pytest.raises(ClusterError, match="pip install torchft"):
        monarch_nb.up(workers=1, cpu=True, ft=True, current=False)


def test_a_setup_cell_runs_on_every_rank(ft_ctl):
    with pytest.raises(ValueError, match="--setup cells run on every rank"):
        ft_ctl.run("x = 1", targets=[0], setup=True)


def test_a_kept_cluster_keeps_its_lighthouse_and_the_loop_its_step_from_kernel_to_kernel(runtime):
    ctl = monarch_nb.up(workers=2, cpu=True, ft=True, keep="10m", name="ft-kept", current=False)
    host, first = ctl.kept["pid"], ctl.ft.pid
    try:
        assert psutil.Process(first).ppid() == host  # the host's child: it outlives the kernel
        ctl.run(SETUP, setup=True, stream=False)
        assert [v[0] for v in ctl.run(train(steps=5, pause=0), stream=False).values()] == [4, 4]
        ctl.detach()
        assert psutil.pid_exists(first)
        ctl = monarch_nb.attach("ft-kept", current=False)
        assert ctl.ft.pid == first
        assert [v[0] for v in ctl.run(train(steps=9, pause=0), stream=False).values()] == [8, 8]
        os.kill(first, signal.SIGKILL)  # the host starts another; the next cell tells the ranks
        assert wait_for(lambda: (kept.load(ctl.kept["id"])["ft"] or {}).get("pid") != first)
        assert [v[0] for v in ctl.run(train(steps=12, pause=0), stream=False).values()] == [11, 11]
        second = ctl.ft.pid
        assert second != first and psutil.Process(second).ppid() == host
    finally:
        ctl.down()
    assert wait_for(lambda: not psutil.pid_exists(host) and not psutil.pid_exists(second))
