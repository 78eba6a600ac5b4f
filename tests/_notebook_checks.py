"""What a notebook's cells must print, checked on the run that the browser test makes of it in a
real JupyterLab (tests/browser/test_notebooks_browser.py): one execution per notebook, its
outputs read from the page's model (nbformat's shape). ``CHECKS`` names a checker per notebook
whose printed text matters; each asserts."""

from __future__ import annotations

import re
from collections.abc import Callable

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def text_of(cell: dict) -> str:
    """What a cell printed and returned, as a reader sees it (no colour codes)."""
    parts = []
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            text = out["text"]
            parts.append(text if isinstance(text, str) else "".join(text))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
        elif "data" in out:
            plain = out["data"].get("text/plain", "")
            parts.append(plain if isinstance(plain, str) else "".join(plain))
    return ANSI.sub("", "".join(parts))


def by_first_line(cells: list[dict]) -> dict[str, str]:
    """The text of each code cell by its first line (the first cell of a given first line)."""
    out: dict[str, str] = {}
    for cell in cells:
        if cell["type"] == "code" and cell["source"]:
            out.setdefault(cell["source"].splitlines()[0], text_of(cell))
    return out


def quickstart(cells: list[dict]) -> None:
    by_source = by_first_line(cells)
    every = by_source["%%monarch"]
    assert "[rank 0] rank 0 of 2" in every and "[ranks 0-1] every rank prints this line" in every
    assert "1 of 2 ranks failed" in by_source["%%monarch --out partial"]
    assert "ZeroDivisionError" in by_source["%%monarch --out partial"]
    assert "ran past --timeout 2 s" in by_source["%%monarch --timeout 2"]
    shell = next(text_of(c) for c in cells if "!echo" in c["source"])
    assert "[rank 1] rank 1 runs in notebooks" in shell and "Wall time:" in shell
    assert "ValueMesh({0: 'Linux', 1: 'Linux'})" in shell
    background = by_source["%%monarch --noblock --out job"]
    assert "[ranks 0-1] step 2" in background  # arrives in the cell that started it
    assert "ValueMesh({0: 0, 1: 100})" in by_source["job.result(timeout=60)"]
    debugged = by_source["%%monarch debug"]  # the post-mortem, unattended
    assert "(Pdb rank 1) p scaled" in debugged and "[rank 1] 20" in debugged
    assert (
        "<- the cell" in by_source["sleeper.wait(1)  # give the ranks a second to start sleeping"]
    )
    # a kept cluster let go of and attached again: the ranks' state is there
    assert "kept as quickstart" in by_source["%monarch up --keep 10m --name quickstart"]
    assert "detached from quickstart" in by_source["%monarch detach"]
    assert "attached to quickstart: 2 ranks" in by_source["%monarch attach quickstart"]
    summed = next(text_of(c) for c in cells if "weights.sum()" in c["source"])
    assert "ValueMesh({0: 0.0, 1: 3.0})" in summed


def actors(cells: list[dict]) -> None:
    out = by_first_line(cells)
    assert "ValueMesh({0: 105, 1: 105})" in out["class Counter(Actor):"]
    assert "ValueMesh({0: 1105, 1: 1115})" in out["for _ in range(1000):"]
    assert (
        "'ping from gpus=0',\n 'pong from gpus=1'" in out["from monarch_nb.actors import context"]
    )
    first, last = (float(x) for x in out["import torch"].split("loss ")[-1].split(" -> "))
    assert last < first / 10
    assert "ZeroDivisionError: division by zero" in out["import os"]
    assert "return 1 / x" in out["import os"]  # the cell's own source line, from the worker
    assert (
        "SupervisionError: actor mesh 'fragile' rank 1 is dead"
        in out["pids = fragile.pid.call().get()"]
    )
    # Whichever says it first names the cause: the worker's own connection closing, or the
    # scheduler removing the worker whose connection closed (a loaded machine orders them
    # either way).
    assert re.search(
        r"fragile rank 1: (the worker process is gone|the scheduler removed the worker: its "
        r"connection to the scheduler closed)",
        out["for name, rank, cause in actors.dead_actors():"],
    )


def fault_tolerance(cells: list[dict]) -> None:
    out = by_first_line(cells)
    # rank 2 killed mid-loop: one line in the training cell, the others going on without it
    assert re.search(r"rank 2 lost at step \d+; 3 of 4 go on", out["%%monarch --noblock --out job"])
    finished = out["result = job.result(timeout=120)"]
    for rank in range(4):
        assert re.search(rf"^rank {rank}: 200 steps, ", finished, re.M), finished
    assert re.search(r"^rank 2: .*\(a new process: it was pid \d+\)$", finished, re.M), finished
    assert "every rank finished at step 200 with the same weights" in finished
    # ft.history() as a table: time, rank, event, step, participants
    rows = [line.split() for line in out["from monarch_nb import ft"].splitlines()[1:]]
    events = [(int(row[2]), row[3]) for row in rows if len(row) == 6]
    assert events == [(2, "lost"), (2, "joining"), (2, "healing"), (2, "back")], events
    status = out["%monarch status"]
    assert re.search(r"torchft: quorum \d+ of ranks 0-3 \(\d participants\) at step 200", status)
    # the exercise: two ranks lost, one after the other, and back
    exercise = out["%%monarch --noblock --out job2"]
    assert len(re.findall(r"rank \d lost at step \d+; \d of 4 go on", exercise)) == 2, exercise
    checked = out["result2 = job2.result(timeout=120)"]  # the exercise's own asserts passed
    assert "lost and back; every rank ended at step 500 with the same weights" in checked


def parallelism(cells: list[dict]) -> None:
    profiled = [text_of(c) for c in cells if c["source"].startswith("%%monarch --profile")]
    assert len(profiled) == 4  # DDP, FSDP, 1F1B, Monarch TP: each its timeline and numbers
    for text in profiled:
        assert "steps 1-3 measured after 1 warm-up" in text, text
        assert "numbers from: CPU ops and collectives" in text and "traces: " in text, text
    bubble = next(text_of(c) for c in cells if "the bubble, measured" in c["source"])
    assert all(f"stage {s}: computing" in bubble for s in range(4)), bubble
    table = next(text_of(c) for c in cells if "PROFILES.items()" in c["source"])
    assert all(name in table for name in ("DDP", "FSDP", "PP (1F1B)", "Monarch TP")), table


CHECKS: dict[str, Callable[[list[dict]], None]] = {
    "01-quickstart.ipynb": quickstart,
    "04-actors.ipynb": actors,
    "06-parallelism.ipynb": parallelism,
    "07-fault-tolerance.ipynb": fault_tolerance,
}
