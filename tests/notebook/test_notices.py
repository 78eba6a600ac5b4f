"""What happened to the cluster between cells (a worker lost, its replacement) is told at the
start of the next command, in a real ipykernel driven through jupyter_client: ahead of what
the command prints, although a kernel sends stdout and stderr from two buffers."""

from __future__ import annotations

import os
import signal

import pytest
from _kernel import CellKernel

LOST = "lost its worker"
REPLACED = "a replacement worker took its place"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    k = CellKernel(tmp_path)
    try:
        k.run("%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist")
        yield k
    finally:
        k.close()


def streams(msgs: list[dict]) -> list[tuple[str, str]]:
    """(stream name, line) for each line the kernel sent, in the order it sent them."""
    return [
        (m["content"]["name"], line)
        for m in msgs
        if m["msg_type"] == "stream"
        for line in m["content"]["text"].splitlines()
    ]


def kill_rank_1(kernel: CellKernel, *, replaced: bool) -> None:
    """SIGKILL rank 1's worker, then wait in a plain cell (which tells nothing) until the
    controller holds the notice of its loss, and of its replacement if ``replaced``."""
    out = kernel.run("%%monarch --targets 1\nimport os\nprint(os.getpid())")
    pid = int(next(line for name, line in streams(out) if name == "stdout").split()[-1])
    os.kill(pid, signal.SIGKILL)
    want = REPLACED if replaced else LOST
    kernel.run(
        "import time, monarch_nb\n"
        "_deadline = time.monotonic() + 60\n"
        f"while not any({want!r} in n for n in monarch_nb.current()._notices):\n"
        "    assert time.monotonic() < _deadline, monarch_nb.current()._notices\n"
        "    time.sleep(0.05)"
    )


def test_a_lost_worker_is_told_before_the_next_cells_output_and_before_down(kernel):
    kill_rank_1(kernel, replaced=True)
    lines = streams(kernel.run("%%monarch\nprint('hello from', rank)"))
    told = [i for i, (name, line) in enumerate(lines) if line.startswith("monarch-nb: ")]
    said = [i for i, (name, line) in enumerate(lines) if "hello from" in line]
    assert any(LOST in lines[i][1] for i in told) and any(REPLACED in lines[i][1] for i in told)
    assert len(said) == 2 and max(told) < min(said), lines
    assert all(lines[i][0] == "stderr" for i in told)

    kill_rank_1(kernel, replaced=False)
    lines = streams(kernel.run("%monarch down"))
    told = [i for i, (name, line) in enumerate(lines) if LOST in line]
    down = [i for i, (name, line) in enumerate(lines) if line == "monarch-nb: cluster shut down"]
    assert told and down and max(told) < down[0], lines  # it came after, as if down lost it
