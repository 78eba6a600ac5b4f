"""What 03-monarch-matrices.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import by_first_line, text_of


def monarch_matrices(cells: list[dict]) -> None:
    by_source = by_first_line(cells)
    assert (
        "M == P_out L P R: True"
        in by_source["k, p, q, l, s = 3, 4, 4, 4, 2  # noqa: E741 (the specification's names)"]
    )
    landed = next(text_of(c) for c in cells if "lands at output" in c["source"])
    assert "element 1 of block 2 lands at output 6" in landed, landed  # a * l + j
    table = by_source[
        'header = ("n", "blocks", "Monarch params", "dense params", "ratio", "saved")'
    ]
    assert re.search(r"1024\s+2\s+1,048,576\s+1,048,576\s+100.0%\s+none", table), table
    assert re.search(r"1024\s+4\s+524,288\s+1,048,576\s+50.0%\s+50.0%", table), table
    # the block pair's rank, n / b² (16 at n = 256, b = 4), not the paper's 1
    assert "n = 256, b = 4: the ranks of the 16 block pairs [16]" in by_source["n, b = 256, 4"]
    timed = by_source["def sync():"]
    assert "dense:" in timed and "monarch:" in timed and "GFLOP/s" in timed, timed
    assert re.search(r"speed-up [\d.]+x for 16x fewer FLOPs", timed), timed
    trained = by_source["torch.manual_seed(0)"]
    assert trained.count("test accuracy") == 2, trained
    # every exercise asks, unanswered, and says so
    asked = [text_of(c) for c in cells if "check." in c["source"] and "answer = ..." in c["source"]]
    assert len(asked) == 5 and all("not answered yet: " in t for t in asked), asked


CHECKS = {"03-monarch-matrices.ipynb": monarch_matrices}
