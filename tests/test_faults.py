"""Worker processes that die: the cell says so, the replacement takes the rank, nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest

import monarch_nb
from monarch_nb import CellError


@pytest.fixture
def own():
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    yield ctl
    ctl.down()


def wait_for(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_sigkill_mid_cell_names_the_rank_and_the_replacement_takes_it(own):
    pid = own.run("import os\nos.getpid()", targets=1).item()
    own.run("kept = 'rank 0 value'")
    handle = own.run(
        "import time\nstart = time.time()\nwhile time.time() - start < 30: pass\nrank",
        block=False,
        targets=1,
    )
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CellError) as info:
        handle.result(timeout=10)
    err = info.value.errors[1]
    assert err.ename == "WorkerLost" and "connection closed" in err.evalue
    notices: list[str] = []
    assert wait_for(
        lambda: (
            notices.extend(own.notices())
            or any("process group was formed again" in n for n in notices)
        )
    )
    assert any("rank 1 on" in n and "lost its worker" in n for n in notices)
    assert any("replacement worker took its place" in n for n in notices)
    mesh = own.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t)\n(t.item(), 'kept' in globals())"
    )
    assert mesh.values() == [(2.0, True), (2.0, False)]
    assert own.run("import os\nos.getpid()", targets=1).item() != pid
