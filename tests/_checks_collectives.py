"""What 01-ranks-and-collectives.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

from _notebook_checks import by_first_line, text_of


def ranks_and_collectives(cells: list[dict]) -> None:
    by_source = by_first_line(cells)
    assert "[rank 3] I am rank 3 of 4" in by_source["%%monarch --out pids"]
    assert "ValueMesh({0: 1, 1: 11, 2: 21, 3: 31})" in by_source["%%monarch --out totals"]
    reduced = by_source["%%monarch --out reduced"]
    assert "3: ([4.0], [10.0])" in reduced
    assert "3: ([40.0], [20.0])" in by_source["%%monarch --out broadcast"]
    exercises = [text_of(c) for c in cells if "check." in c["source"]]
    assert len(exercises) == 7 and all("not answered yet:" in t for t in exercises)
    # the hang: stacks name the waiting ranks, the collective and the cell's line
    stacks = by_source["stuck.wait(1)  # give ranks 0 and 1 a second to reach the all_reduce"]
    assert "ranks 0-1 wait in all_reduce #" in stacks and "ranks 2-3 are at #" in stacks
    assert "dist.all_reduce(t)" in stacks and "<- the cell" in stacks
    interrupted = by_source["import time"]  # stuck.interrupt(): set free at once
    assert "KeyboardInterrupt" in interrupted and "do not stop" not in interrupted, interrupted
    healed = by_source["%%monarch --out healed"]
    assert "the gloo process group was formed again" in healed
    assert "ValueMesh({0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0})" in healed
    stopped = by_source["%%monarch --timeout 2"]  # the stop button's interrupt, unattended
    assert "interrupted while it waited in a collective the other ranks had left" in stopped
    assert "the gloo process group was formed again" in stopped


CHECKS = {"01-ranks-and-collectives.ipynb": ranks_and_collectives}
