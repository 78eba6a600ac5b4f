"""What 06-parallelism.ipynb must print (tests/_notebook_checks.py)."""

from __future__ import annotations

from _notebook_checks import text_of


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


CHECKS = {"06-parallelism.ipynb": parallelism}
