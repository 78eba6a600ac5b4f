"""What 08-model-parallelism.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

from _checks_data_parallel import _profiled, _unanswered
from _notebook_checks import by_first_line, text_of


def model_parallelism(cells: list[dict]) -> None:
    out = by_first_line(cells)
    _profiled(cells, 2)  # 1F1B, Monarch TP
    _unanswered(cells, 5)
    tp = out['assert runs.compare("TP", memory="held_memory") < 1e-5']
    assert "counted by CommDebugMode: 2 forward, 4 backward" in tp, tp
    assert "by formula: 576.0 KiB" in tp, tp
    held = out["def shares(tp, dp=1):"]
    assert "TP: a rank holds 155.6 KiB (parameters, gradients, momentum), by formula 155.6" in held
    drawn = out["STAGES, MICRO = 4, 4"]
    assert "GPipe: 14 slots, every stage waits 43%" in drawn, drawn
    assert "1F1B: 14 slots, every stage waits 43%" in drawn and "[4, 3, 2, 1]" in drawn, drawn
    bubble = out['assert runs.compare("PP", memory="held_memory") < 1e-5']
    assert all(f"stage {s}: computing" in bubble for s in range(4)), bubble
    assert "formula (p-1)/(m+p-1): 43%" in bubble, bubble
    layout = out["layout = %monarch pull two_d_layout"]
    assert "layer norm: ['ranks 0,1', 'ranks 2,3']" in layout, layout
    table = next(text_of(c) for c in cells if "runs.table()" in c["source"])
    assert all(name in table for name in ("PP (1F1B)", "Monarch TP")), table


CHECKS = {"08-model-parallelism.ipynb": model_parallelism}
