"""What a notebook's cells must print, checked on the run that the browser test makes of it in a
real JupyterLab (tests/browser/test_notebooks_browser.py): one execution per notebook, its
outputs read from the page's model (nbformat's shape). ``CHECKS`` names a checker per notebook
whose printed text matters; each asserts. A notebook's checker lives in a module of its own,
``tests/_checks_<topic>.py``, whose ``CHECKS`` names the notebooks it checks."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def text_of(cell: dict) -> str:
    """What a cell printed and returned, as a reader sees it (no colour codes)."""
    parts = []
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            text = out["text"]
            parts.append(text if isinstance(text, str) else "".join(text))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
        elif "data" in out:
            plain = out["data"].get("text/plain", "")
            parts.append(plain if isinstance(plain, str) else "".join(plain))
    return ANSI.sub("", "".join(parts))


def by_first_line(cells: list[dict]) -> dict[str, str]:
    """The text of each code cell by its first line (the first cell of a given first line)."""
    out: dict[str, str] = {}
    for cell in cells:
        if cell["type"] == "code" and cell["source"]:
            out.setdefault(cell["source"].splitlines()[0], text_of(cell))
    return out


def _gathered() -> dict[str, Callable[[list[dict]], None]]:
    checks: dict[str, Callable[[list[dict]], None]] = {}
    for path in sorted(Path(__file__).parent.glob("_checks_*.py")):
        checks.update(importlib.import_module(path.stem).CHECKS)
    return checks


CHECKS = _gathered()
