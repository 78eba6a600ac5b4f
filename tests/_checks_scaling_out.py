"""What 06-scaling-out.ipynb must print where no Slurm answers (tests/_notebook_checks.py); its
Slurm part on a real Slurm is tests/controller/test_slurm.py's."""

from __future__ import annotations

from _notebook_checks import by_first_line, text_of


def scaling_out(cells: list[dict]) -> None:
    out = by_first_line(cells)
    assert "scaled to 1 rank; rank 1 left" in out["%monarch scale 1"]
    assert "scaled to 2 ranks; rank 1 joined" in out["%monarch scale 2 --wait 120"]
    regrown = next(text_of(c) for c in cells if "fresh =" in c["source"])
    assert "(2, 2, False," in regrown and "(2, 2, True," in regrown, regrown
    joined = out["%monarch connect --scheduler-file {scheduler_file} --workers 2 --timeout 30"]
    assert "connected to 2 ranks" in joined, joined
    # down only disconnects from a cluster it joined: the three processes run on
    assert (
        "3 of 3 processes still run"
        in out["running = [proc.pid for proc in procs if proc.poll() is None]"]
    )
    asked = [text for line, text in out.items() if line.startswith("answer = ...")]
    asked.append(out["from monarch_nb.examples.exercises import scaling_out as check"])
    assert len(asked) == 4 and all(t.startswith("not answered yet: ") for t in asked), asked


CHECKS = {"06-scaling-out.ipynb": scaling_out}
