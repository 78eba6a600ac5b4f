"""``monarch_nb.label(stage="embed")``: name what a rank does, for the live panel, the sidebar
and ``%monarch status`` (a pipeline's stages, an expert's group). The rank's mesh coordinates
(``dp=1 tp=0``) are labels too, set by ``mesh.py``; the telemetry carries both (recorder.py)."""

from __future__ import annotations

import warnings
from typing import Any

MAX_LABELS = 8
MAX_TEXT = 40

_warned_outside = False


def label(**labels: Any) -> None:
    """Label this rank, e.g. ``label(stage=f"stage {i} of {n}")``; ``None`` removes a label.
    Values are shown as text (at most 40 characters); a rank keeps at most 8 labels. Outside a
    monarch worker this warns once and does nothing."""
    from monarch_nb.rank.engine import get_engine

    global _warned_outside
    engine = get_engine()
    if engine is None:
        if not _warned_outside:
            _warned_outside = True
            warnings.warn(
                "monarch_nb.label() called outside a cluster worker; nothing is shown "
                "(run it in a %%monarch cell or an actor)",
                UserWarning,
                stacklevel=2,
            )
        return
    mine = dict(engine.user_labels)
    for key, value in labels.items():
        if value is None:
            mine.pop(key, None)
            continue
        if isinstance(value, bytes) or not isinstance(value, str | int | float):
            raise TypeError(f"label(): {key} must be text or a number, got {type(value).__name__}")
        text = str(value)
        if len(text) > MAX_TEXT:
            raise ValueError(f"label(): {key} is {len(text)} characters; at most {MAX_TEXT}")
        mine[key] = text
    if len(mine) > MAX_LABELS:
        raise ValueError(f"label(): a rank keeps at most {MAX_LABELS} labels; remove one first")
    engine.user_labels = mine
