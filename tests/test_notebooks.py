"""Every notebook in notebooks/ runs end to end in a real Jupyter kernel."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return nb


def text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
    return "".join(parts)


def test_there_are_notebooks():
    assert any(p.name == "01-quickstart.ipynb" for p in NOTEBOOKS)


_executed: dict[Path, nbformat.NotebookNode] = {}


def executed(path: Path) -> nbformat.NotebookNode:
    if path not in _executed:
        _executed[path] = execute(path)
    return _executed[path]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = executed(path)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o["output_type"] == "error"]
        expected = "raises-exception" in cell.metadata.get("tags", [])
        assert bool(errors) == expected, f"{path.name}: {cell.source[:60]!r}: {text_of(cell)}"


def test_quickstart_shows_rank_output_errors_and_background_cells():
    nb = executed(next(p for p in NOTEBOOKS if p.name == "01-quickstart.ipynb"))
    by_source: dict[str, str] = {}
    for c in nb.cells:
        if c.cell_type == "code":
            by_source.setdefault(c.source.splitlines()[0], text_of(c))
    every = by_source["%%monarch"]
    assert "[rank 0] rank 0 of 2" in every and "[ranks 0-1] every rank prints this line" in every
    assert "1 of 2 ranks failed" in by_source["%%monarch --out partial"]
    assert "ZeroDivisionError" in by_source["%%monarch --out partial"]
    assert "ran past --timeout 2 s" in by_source["%%monarch --timeout 2"]
    shell = next(text_of(c) for c in nb.cells if "!echo" in c.source)
    assert "[rank 1] rank 1 runs in notebooks" in shell and "Wall time:" in shell
    assert "ValueMesh({0: 'Linux', 1: 'Linux'})" in shell
    background = by_source["%%monarch --noblock --out job"]
    assert "[ranks 0-1] step 2" in background  # arrives in the cell that started it
    assert "ValueMesh({0: 0, 1: 100})" in by_source["job.result(timeout=60)"]
