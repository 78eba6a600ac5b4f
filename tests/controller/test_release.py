"""A rank's failure releases the others at once (dispatch/releasing.py, rank/release.py).

Without it, a cell whose rank raised before a collective waited for gloo's timeout (30 s) on
the others, named that timeout in its headline, and left the group broken for the next cell.
Real clusters, real gloo groups, a real IPython shell; the wall-time bounds are several times
what they take here and far under the 30 s of the group's timeout.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time

import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb import CellError

ALL_REDUCE = (
    "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
)
RELEASED_WITHIN = 10.0  # s; the group's timeout is 30


def test_a_rank_that_raises_releases_the_others_first_cause_first(cell, clean):
    # rank 0 holds the group in a DDP model, so leaving the group frees nothing: the release
    # must cut its connections
    cell(
        "%%monarch\nimport torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(2, 2))"
    )
    start = time.monotonic()
    cell(
        "%%monarch\nif rank == 1:\n    model\nt = torch.ones(1)\ndist.all_reduce(t)",
        expect_error=True,
    )
    assert time.monotonic() - start < RELEASED_WITHIN
    error = cell.error
    assert error.headline == "rank 1: NameError: name 'model' is not defined (rank 0 released)"
    assert error.errors[1].ename == "NameError"
    assert (error.errors[0].ename, error.errors[0].evalue) == ("Released", "rank 1 failed")
    rendered = error._render_traceback_()
    assert rendered.index("[rank 1] NameError: name 'model' is not defined") < rendered.index(
        "[rank 0] Released: rank 1 failed"
    )
    assert "dist.all_reduce(t)" in "\n".join(rendered)  # where the released rank was waiting
    assert "formed again" in cell.err
    start = time.monotonic()
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]  # a working group
    assert time.monotonic() - start < RELEASED_WITHIN


def test_ranks_in_python_code_are_released_too_and_a_group_in_step_is_kept(cell, clean):
    cell("%%monarch\nimport torch, torch.distributed as dist\nbefore = dist.group.WORLD")
    start = time.monotonic()
    cell(
        "%%monarch\nimport time\nif rank == 1:\n    raise ValueError('bad batch')\n"
        "end = time.time() + 30\nwhile time.time() < end:\n    pass",
        expect_error=True,
    )
    assert time.monotonic() - start < RELEASED_WITHIN
    assert cell.error.headline == "rank 1: ValueError: bad batch (rank 0 released)"
    assert "formed again" not in cell.err  # no collective between them: the group stays
    assert cell("%%monarch\ndist.group.WORLD is before").values() == [True, True]


def test_a_collective_that_gave_up_is_never_handed_to_the_next_cell(cell, clean):
    # rank 1 waits alone in a collective with a 2 s timeout while rank 0 succeeds: nothing
    # failed while it ran, so nothing releases it; gloo gives up, and the group is formed
    # again rather than handed, broken, to the next cell
    cell(
        "%%monarch\nimport datetime, torch, torch.distributed as dist\n"
        "group = dist.distributed_c10d._get_default_group()\n"
        "if rank == 1:\n"
        "    group.set_timeout(datetime.timedelta(seconds=2))\n"
        "    dist.all_reduce(torch.ones(1))",
        expect_error=True,
    )
    assert set(cell.error.errors) == {1}
    assert "a collective gave up" in cell.err and "formed again" in cell.err
    assert cell(f"%%monarch\n{ALL_REDUCE}").values() == [2.0, 2.0]


def test_a_background_cell_interrupted_in_a_collective_its_peer_never_calls_ends_at_once(clean):
    # rank 0 waits in an all_reduce that rank 1 never calls: the interrupt alone cannot end a
    # wait in gloo's C code, so the handle's interrupt cuts the group too; the next cell finds
    # it formed again instead of waiting out the group's timeout (30 s) behind rank 0
    handle = clean.run(
        "import torch, torch.distributed as dist\n"
        "if rank == 0:\n    dist.all_reduce(torch.ones(1))",
        block=False,
    )
    assert wait_for(
        lambda: "rank 0 waits in all_reduce" in (clean.stacks().summary or ""), timeout=10
    )
    handle.interrupt()
    with pytest.raises(CellError) as info:
        handle.result(timeout=RELEASED_WITHIN)
    # set free, not StillRunning (as the rank was while it waited out the group's timeout)
    assert {r: e.ename for r, e in info.value.errors.items()} == {0: "KeyboardInterrupt"}
    assert clean.run(ALL_REDUCE).values() == [2.0, 2.0]


def test_fsdp_on_a_2d_mesh_is_released_and_trains_again(mesh4, cell):
    setup = """
    %%monarch
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    fully_shard(model, mesh=mesh["dp"])
    """
    cell(textwrap.dedent(setup).strip())
    start = time.monotonic()
    cell(
        "%%monarch\nif rank == 3:\n    raise RuntimeError('out of data')\n"
        "model(torch.ones(4, 8)).sum().backward()",
        expect_error=True,
    )
    assert time.monotonic() - start < RELEASED_WITHIN
    error = cell.error
    assert error.headline.startswith("rank 3: RuntimeError: out of data (")
    # rank 1 waited for rank 3 in their dp group; ranks 0 and 2, the other dp group, finish
    # their step, unless a loaded machine keeps them running past the release's grace
    assert error.errors[1].ename == "Released"
    assert set(error.errors) | set(error.results.ranks) == {0, 1, 2, 3}
    assert {e.ename for r, e in error.errors.items() if r != 3} == {"Released"}
    # the mesh's groups were cut with the world's and built again: shard again and train
    cell(textwrap.dedent(setup).strip())
    losses = cell("%%monarch\nloss = model(torch.ones(4, 8)).sum()\nloss.backward()\nloss.item()")
    assert len(set(losses.values())) == 1


def test_a_killed_worker_releases_the_others_and_its_replacement_joins_the_group():
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    try:
        pid = ctl.run("import os\nos.getpid()", targets=1).item()
        handle = ctl.run(
            "import time, torch, torch.distributed as dist\n"
            "if rank == 1:\n    time.sleep(60)\ndist.all_reduce(torch.ones(1))",
            block=False,
        )
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(CellError) as info:
            handle.result(timeout=RELEASED_WITHIN)
        assert time.monotonic() - start < RELEASED_WITHIN
        assert info.value.errors[1].ename == "WorkerLost"
        assert info.value.headline.startswith("rank 1: WorkerLost")
        notices: list[str] = []
        assert wait_for(
            lambda: notices.extend(ctl.notices()) or any("formed again" in n for n in notices),
            timeout=60,
        ), notices
        assert ctl.run(ALL_REDUCE).values() == [2.0, 2.0]
    finally:
        ctl.down()


SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
if os.environ["RANK"] == "1":
    sys.exit(4)
dist.all_reduce(torch.ones(1))  # waits for rank 1 until the group's timeout (30 s)
"""


def test_a_script_that_fails_on_one_rank_ends_the_others(cell, clean, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    cell("%monarch run train.py", expect_error=True)
    assert time.monotonic() - start < RELEASED_WITHIN
    # rank 0's script is released, or sees its peer gone and fails of itself first
    assert re.fullmatch(
        r"train\.py failed on rank 1: train\.py exited with code 4"
        r"( \(rank 0 released\)|; rank 0 failed too)",
        cell.error.headline,
    ), cell.error.headline
    assert cell("%%monarch\nrank").values() == [0, 1]  # the ranks are free for the next cell
