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
    # the replacement trained only the steps after it came back
    trained = {
        int(r): int(n)
        for r, n in re.findall(r"^rank (\d): 200 steps, (\d+) trained", finished, re.M)
    }
    # (a step that failed to commit when rank 2 went is tried again: 200 or more for the others)
    assert min(trained[0], trained[1], trained[3]) >= 200 > trained[2], trained
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
    checked = out["result2 = job2.result(timeout=120)"]  # the exercise's checker, on the outcome
    assert re.search(
        r"^right: ranks \d and \d lost and back; "
        r"every rank ended at step 600 with the same weights",
        checked,
        re.M,
    ), checked
    # the other exercises, unanswered, say so and the notebook runs on
    asked = [text for line, text in out.items() if line.startswith("answer = ...")]
    asked.append(out["from monarch_nb.examples.exercises import fault_tolerance as check"])
    assert len(asked) == 4 and all(t.startswith("not answered yet: ") for t in asked), asked


CHECKS = {"10-fault-tolerance.ipynb": fault_tolerance}
