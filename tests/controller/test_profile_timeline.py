"""``%%monarch --profile``: every rank's cell under torch.profiler on real worker processes with a
real gloo group, the traces back in the kernel, aligned, written and analysed."""

from __future__ import annotations

import json
import textwrap

import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb.controller import profiling
from monarch_nb.dispatch.results import CellError

DDP_LOOP = """
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({steps}):
    if rank == {slow}:
        time.sleep(0.04)                 # the straggler, on purpose
    loss = model(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    {fail}
step
"""


def loop(steps=6, slow=1, fail="pass") -> str:
    return textwrap.dedent(DDP_LOOP.format(steps=steps, slow=slow, fail=fail))


def test_a_profiled_loop_shows_every_rank_names_the_slowed_one_and_writes_its_traces(
    clean, cell, tmp_path
):
    cell(f"%%monarch --profile dir={tmp_path}\n{loop()}")
    profile = clean.last_profile
    numbers = profile.analysis.numbers
    assert numbers.straggler_rank == 1, (numbers.straggler, numbers.rows)
    assert numbers.straggler.startswith("rank 1 is ")
    assert numbers.straggler.endswith("the others wait for it in all_reduce")
    assert numbers.source == "CPU ops and collectives"
    assert [row["rank"] for row in numbers.rows] == [0, 1]
    assert all(row["steps"] == 3 for row in numbers.rows)  # steps 1-3, after step 0's warm-up
    assert "steps 1-3 measured after 1 warm-up" in profile.title
    # printed under the cell: the sentence and where the traces are, and nothing of kineto's
    assert "ERROR" not in cell.out + cell.err and "profiler_start" not in cell.out + cell.err
    assert numbers.straggler in cell.out
    assert str(profile.directory) in cell.out
    assert profile.directory.parent == tmp_path
    names = sorted(p.name for p in profile.directory.iterdir())
    assert names == ["merged.json", "meta.json", "rank-0.json", "rank-1.json"]
    merged = json.loads((profile.directory / "merged.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    meta = json.loads((profile.directory / "meta.json").read_text())
    assert meta["ranks"]["0"]["offset_ns"] == 0  # one host: one clock
    assert meta["ranks"]["1"]["steps"] == 6
    timeline = profile.analysis.timeline
    assert set(timeline.bars["kind"]) == {"compute", "comm", "idle"}
    assert {"gloo:all_reduce"} <= set(timeline.bars["name"])
    assert sorted(set(zip(timeline.steps["step"], timeline.steps["warmup"], strict=True))) == [
        (0, True),
        (1, False),
        (2, False),
        (3, False),
    ]
    # the picture again, from the folder alone, as a later kernel would: %monarch profile --last
    clean.last_profile = None
    cell(f"import os; os.environ['{profiling.DIR_ENV}'] = {str(tmp_path)!r}")
    try:
        cell("%monarch profile --last")
        shown = cell.out
    finally:
        cell(f"del os.environ['{profiling.DIR_ENV}']")
    assert numbers.straggler in shown and str(profile.directory) in shown


def test_a_rank_that_fails_is_marked_and_the_others_trace_is_still_shown(clean, tmp_path):
    fail = "if rank == 0 and step == 2: raise ValueError('bad batch')"
    with pytest.raises(CellError, match="bad batch"):
        clean.run(loop(slow=-1, fail=fail), profile={"dir": tmp_path, "active": 2})
    timeline = clean.last_profile.analysis.timeline
    assert timeline.status[0] == "error"  # rank 1 is released from its all_reduce: "error" too
    assert set(timeline.bars["rank"]) == {0, 1}  # the failing rank's steps up to its error too
    assert (clean.last_profile.directory / "rank-0.json").exists()
    assert clean.run("rank").values() == [0, 1]


def test_a_rank_lost_mid_profile_is_marked_and_the_cluster_stays_usable(tmp_path):
    own = monarch_nb.up(workers=2, cpu=True, current=False)
    try:
        die = "if rank == 1 and step == 2: import os; os.kill(os.getpid(), 9)"
        with pytest.raises(CellError):
            own.run(loop(slow=-1, fail=die), profile={"dir": tmp_path})
        analysis = own.last_profile.analysis
        assert analysis.timeline.status[1] == "lost"
        assert set(analysis.timeline.bars["rank"]) == {0}  # rank 0's steps up to the loss
        assert [row["rank"] for row in analysis.numbers.rows] == [0]
        assert any("rank 1" in note for note in analysis.numbers.notes)
        notices: list[str] = []
        assert wait_for(
            lambda: (
                notices.extend(own.notices())
                or any("process group was formed again" in n for n in notices)
            )
        )
        assert own.run("rank", profile={"dir": tmp_path}).values() == [0, 1]
        assert own.last_profile.analysis.timeline.status == {0: "ok", 1: "ok"}
    finally:
        own.down()


def test_a_cell_without_an_optimizer_step_is_profiled_whole(clean, tmp_path):
    clean.run(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1000)\nfor _ in range(5): dist.all_reduce(t)\n",
        profile=f"dir={tmp_path}",
    )
    profile = clean.last_profile
    assert "the whole cell (it took no optimizer step)" in profile.title
    assert all(row["steps"] == 1 for row in profile.analysis.numbers.rows)
    assert profile.analysis.numbers.rows[0]["comm_ms"] > 0


@pytest.mark.parametrize(
    "line, says",
    [
        ("--profile --noblock", "cannot be --noblock"),
        ("--profile active=0", "--profile takes wait=N,warmup=N,active=N"),
        ("--profile steps=3", "got 'steps=3'"),
        ("--profile dir=/proc/no/such", "cannot write the profile's traces under /proc/no/such"),
    ],
)
def test_bad_profile_arguments_are_one_line_and_nothing_runs(clean, cell, line, says):
    cell("%%monarch\nx = 1")
    cell(f"%%monarch {line}\nx = 2", expect_error=True)
    assert says in str(cell.error) and "\n" not in str(cell.error)
    assert clean.pull("x").values() == [1, 1]


def test_profile_without_last_or_a_folder_says_what_it_takes(cell, tmp_path):
    cell("%monarch profile", expect_error=True)
    assert "give --last or a profile's folder" in str(cell.error)
    cell(f"%monarch profile {tmp_path}", expect_error=True)
    assert "holds no profile" in str(cell.error)
