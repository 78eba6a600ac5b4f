"""What 02-working-with-the-cluster.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

from _notebook_checks import by_first_line, text_of


def quickstart(cells: list[dict]) -> None:
    by_source = by_first_line(cells)
    every = by_source["%%monarch"]
    assert "[rank 0] rank 0 of 2" in every and "[ranks 0-1] every rank prints this line" in every
    scattered = next(text_of(c) for c in cells if "print(rank, shard)" in c["source"])
    assert "[rank 1] 1 [5, 6, 7, 8, 9]" in scattered  # the answer to exercise 2
    assert "1 of 2 ranks failed" in by_source["%%monarch --out partial"]
    assert "ZeroDivisionError" in by_source["%%monarch --out partial"]
    assert "ValueMesh({0: -1.0})" in by_source["partial  # the ranks that succeeded: rank 0"]
    assert "ran past --timeout 2 s" in by_source["%%monarch --timeout 2"]
    shell = next(text_of(c) for c in cells if "!echo" in c["source"])
    assert "[rank 1] rank 1 runs in notebooks" in shell and "Wall time:" in shell
    assert "ValueMesh({0: 'Linux', 1: 'Linux'})" in shell
    # the exercises' answers, as the cells after them show them
    assert "ValueMesh({1: 7})" in by_source["%%monarch --targets 1"]
    echoed = next(
        text_of(c) for c in cells if c["source"].startswith("%%monarch --targets 1\nout = !echo")
    )
    assert "ValueMesh({1: ['1']})" in echoed, echoed
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


CHECKS = {"02-working-with-the-cluster.ipynb": quickstart}
