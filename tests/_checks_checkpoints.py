"""What 09-checkpoints-and-faults.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import by_first_line, text_of


def checkpoints_and_faults(cells: list[dict]) -> None:
    out = by_first_line(cells)
    # 4 ranks' bands of 32 rows, read back as 2 ranks' halves, the losses those of one process
    saved = out['step_dir = f"{ckpt}/step-00000004"']
    for r in range(4):
        assert f"saved by rank {r}: rows {32 * r}-{32 * r + 31}" in saved, saved
    resharded = out["loaded = %monarch pull step"]
    assert "rank 0 holds rows 0-63: the bands saved by ranks [0, 1]" in resharded, resharded
    assert "rank 1 holds rows 64-127: the bands saved by ranks [2, 3]" in resharded, resharded
    worst = re.search(r"loaded by 2; largest difference from one process (\S+)", resharded)
    assert worst and float(worst[1]) < 1e-4, resharded
    # rank 3 killed: the cell's headline names it, and the replacement comes back set up
    killed = _cell(cells, "model = run(faults, kill_at=KILL_AT)")  # its first line is shared
    assert "rank 3: WorkerLost: on " in killed, killed[:2000]  # the headline names the rank
    notices = out["import time"]
    for said in (
        "rank 3 on",
        "lost its worker",
        "a replacement worker took its place",
        "process group was formed again",
        "rank 3: the 2 --setup cells ran again",
    ):
        assert said in notices, notices
    lost = out["%monarch push faults"]
    assert "saved steps [4, 8]; the latest is 8" in lost, lost
    assert "the first run reached step 10: steps 8-10 are lost" in lost, lost
    resumed = out["runs = %monarch pull by_step"]
    assert "resumed at step 8, trained to step 11" in resumed, resumed
    worst = re.search(r"losses (\S+), final weights (\S+)$", resumed, re.M)
    assert worst and max(float(worst[1]), float(worst[2])) < 1e-4, resumed
    table = next(text_of(c) for c in cells if "plots.interval_table(" in c["source"])
    assert re.search(r"^\s+8\s+\d+%\s+3\.5\s+7$", table, re.M), table
    # the exercises, unanswered, say so and do not fail
    for first, asked in (
        ("from monarch_nb.examples.exercises import checkpoints as check", 2),
        ("answer = ...  # the step the resumed run starts with", 3),
        ("answer = ...  # seconds between checkpoints", 1),
    ):
        assert out[first].count("not answered yet:") == asked, out[first]


def _cell(cells: list[dict], line: str) -> str:
    """The text of the code cell that has ``line``."""
    return next(text_of(c) for c in cells if c["type"] == "code" and line in c["source"])


CHECKS = {"09-checkpoints-and-faults.ipynb": checkpoints_and_faults}
