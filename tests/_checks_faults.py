"""What 10-fault-tolerance.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import by_first_line


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


CHECKS = {"10-fault-tolerance.ipynb": fault_tolerance}
