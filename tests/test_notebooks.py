"""What notebooks print, read from a real Jupyter kernel's outputs (nbclient).

That every notebook runs end to end with no error but where a cell is tagged
`raises-exception` is checked once, in a real JupyterLab: tests/browser/test_notebooks_browser.py
(which `make test` runs); here only the notebooks whose printed text is checked are executed:
01 below, 04 in tests/actors/test_actors.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
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


_executed: dict[Path, nbformat.NotebookNode] = {}


def executed(path: Path) -> nbformat.NotebookNode:
    if path not in _executed:
        _executed[path] = execute(path)
    return _executed[path]


def test_quickstart_shows_rank_output_errors_and_background_cells():
    nb = executed(next(p for p in NOTEBOOKS if p.name == "01-quickstart.ipynb"))
    by_source: dict[str, str] = {}
    for c in nb.cells:
        if c.cell_type == "code":
            failed = any(o["output_type"] == "error" for o in c.outputs)
            assert failed == ("raises-exception" in c.metadata.get("tags", [])), c.source[:60]
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
    debugged = by_source["%%monarch debug"]  # the post-mortem, unattended
    assert "(Pdb rank 1) p scaled" in debugged and "[rank 1] 20" in debugged
    assert (
        "<- the cell" in by_source["sleeper.wait(1)  # give the ranks a second to start sleeping"]
    )
    # a kept cluster let go of and attached again: the ranks' state is there
    assert "kept as quickstart" in by_source["%monarch up --keep 10m --name quickstart"]
    assert "detached from quickstart" in by_source["%monarch detach"]
    assert "attached to quickstart: 2 ranks" in by_source["%monarch attach quickstart"]
    summed = next(text_of(c) for c in nb.cells if "weights.sum()" in c.source)
    assert "ValueMesh({0: 0.0, 1: 3.0})" in summed
