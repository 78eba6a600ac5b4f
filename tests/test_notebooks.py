"""What the notebooks need, read without running them.

Every notebook is run once, in a real JupyterLab (tests/browser/test_notebooks_browser.py, which
`make test` runs): nothing broken and every cell run, but where a cell is tagged
`raises-exception`, and what notebooks 02 and 05 print (tests/_notebook_checks.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "01-ranks-and-collectives.ipynb" for p in NOTEBOOKS)


IMPORT = re.compile(r"\s*(?:from|import)\s+([A-Za-z_]\w*)")


def test_a_notebook_handed_out_needs_nothing_beside_it():
    """What a notebook imports and runs comes from installed packages, never from files beside
    it (the browser test runs them from a folder holding nothing else)."""
    problems = []
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            for line in cell.source.splitlines() if cell.cell_type == "code" else ():
                imported = IMPORT.match(line)
                if imported and importlib.util.find_spec(imported[1]) is None:
                    problems.append(f"{path.name}: {line.strip()!r} imports no installed module")
                run = line.strip().startswith("%monarch run ") and " -m " not in line
                if run or "../" in line:
                    problems.append(f"{path.name}: {line.strip()!r} names a file beside it")
    assert not problems, "\n".join(problems)


def test_the_notebooks_are_kept_without_outputs():
    """A student's copy shows only what their own run draws; the answers notebooks too."""
    kept = []
    for path in [*NOTEBOOKS, *sorted((NOTEBOOKS[0].parent / "answers").glob("*.ipynb"))]:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
                kept.append(f"{path.name} cell {i}")
    assert not kept, f"outputs kept (jupyter nbconvert --clear-output --inplace): {kept}"
