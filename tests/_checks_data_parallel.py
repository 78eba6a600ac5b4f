"""What 07-data-parallelism.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

import re

from _notebook_checks import by_first_line, text_of


def _profiled(cells: list[dict], n: int) -> None:
    profiled = [text_of(c) for c in cells if c["source"].startswith("%%monarch --profile")]
    assert len(profiled) == n, len(profiled)
    for text in profiled:
        assert "steps 1-3 measured after 1 warm-up" in text, text
        assert "numbers from: CPU ops and collectives" in text and "traces: " in text, text


def _unanswered(cells: list[dict], n: int) -> None:
    """Every exercise runs unanswered and says so (the answers are in notebooks/answers/)."""
    asked = [
        text_of(c)
        for c in cells
        if c["source"].startswith("answer = ...") or ("\nanswer = ..." in c["source"])
    ]
    assert len(asked) == n, len(asked)
    assert all(t.startswith("not answered yet: ") for t in asked), asked


def data_parallelism(cells: list[dict]) -> None:
    out = by_first_line(cells)
    _profiled(cells, 2)  # DDP, FSDP: each its timeline and numbers
    _unanswered(cells, 6)
    ddp = out['assert runs.compare("DDP", memory="held_memory") < 1e-5']
    assert re.search(r"DDP: final loss [\d.]+, largest difference from one process", ddp), ddp
    assert "the formula 2(n-1)/n x 4 x params = 297.8 KiB" in ddp, ddp
    fsdp = out['assert runs.compare("FSDP", memory="held_memory") < 1e-5']
    assert "compute overlapped, from its timeline: 0%" in fsdp, fsdp
    memory = out['shares = {"DDP": [p.numel() for p in model.parameters()]}']
    for line in (
        "DDP, measured       198.5      198.5      198.5",
        "FSDP, formula        49.6       49.6       49.6",
        "DDP holds 4 times FSDP's bytes on each rank",
    ):
        assert line in memory, memory
    bytes_ = out["gloo = %monarch pull gloo_wrote"]
    assert re.search(r"reduce-scatter     148\.9           29\d\.\d", bytes_), bytes_
    assert "FSDP a step     446.6" in bytes_, bytes_
    mistake = out["wanted = sum(p.double().sum().item() for p in make_model().parameters())"]
    assert "FSDP, seed=rank: final loss" in mistake, mistake
    fixed = out["trained_from = %monarch pull trained_from"]
    assert re.search(r"every rank's checksum ([\d.]+) = the one-process model's \1", fixed), fixed
    table = next(text_of(c) for c in cells if "runs.table()" in c["source"])
    assert all(name in table for name in ("DDP", "FSDP", "overlap")), table


CHECKS = {"07-data-parallelism.ipynb": data_parallelism}
