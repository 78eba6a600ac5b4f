"""Every code example in the docs runs as written, and every path and link they give exists.

The fences say how an example runs (docs/README.md, "The examples run as written"): ```python
is a script run in a subprocess, ```ipython the cells of a page run in order in one real IPython
shell of the page's own (a subprocess, so that each page starts fresh and its cluster goes with
it), ```python notrun / ```ipython notrun need what this machine lacks and are only parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def _root() -> Path:
    here = Path(__file__).resolve().parent
    while not (here / "pyproject.toml").exists():
        here = here.parent
    return here


ROOT = _root()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md"]
RUN = {"python", "ipython"}
NOT_RUN = {"", "bash", "sh", "console", "text", "yaml"}
SCRIPT_TIMEOUT = 180
CELL_TIMEOUT = 120
# Lines in a script's or shell's output that mean something failed even where the exit status
# says not (a worker's traceback printed by its nanny, say).
FAILED = re.compile(r"^Traceback \(most recent call last\)|^\S*Error: ", re.M)


@dataclass
class Cell:
    source: str
    line: int  # in the page
    out: str | None = None  # an ``Out[N]:`` line to compare with the value's repr


@dataclass
class Example:
    page: str  # relative to the repository
    line: int  # of the opening fence
    words: list[str]
    source: str
    cells: list[Cell] = field(default_factory=list)

    @property
    def lang(self) -> str:
        return self.words[0] if self.words else ""

    @property
    def runs(self) -> bool:
        return self.lang in RUN and "notrun" not in self.words

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


def _fences(path: Path) -> list[Example]:
    """The fenced blocks of a markdown page, an indented fence (in a list item) included."""
    page = str(path.relative_to(ROOT))
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[i]):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        example = Example(page, start, info.split(), "\n".join(body) + "\n")
        if example.lang == "ipython":
            example.cells = _cells(example.source, start + 1)
        found.append(example)
    return found


_IN = re.compile(r"^In \[\d+\]: ?(.*)$")
_MORE = re.compile(r"^\s*\.\.\.:(?: (.*))?$")
_OUT = re.compile(r"^Out\[\d+\]: (.*)$")


def _cells(text: str, first_line: int) -> list[Cell]:
    """An IPython session (``In [N]:`` / ``...:`` prompts, other lines what it printed) as its
    cells; text without prompts is one cell."""
    lines = text.splitlines()
    if not any(_IN.match(line) for line in lines):
        return [Cell(text, first_line)]
    cells: list[Cell] = []
    body: list[str] | None = None
    for n, line in enumerate(lines, first_line):
        if m := _IN.match(line):
            body = [m.group(1)]
            cells.append(Cell("", n))
        elif (m := _MORE.match(line)) and body is not None:
            body.append(m.group(1) or "")
        else:
            if m := _OUT.match(line):
                cells[-1].out = m.group(1)
            body = None  # output: the cell's source has ended
        if body is not None:
            cells[-1].source = "\n".join(body) + "\n"
    return cells


EXAMPLES = [e for page in PAGES for e in _fences(page)]
RUNS = [e for e in EXAMPLES if e.runs]
PARSED = [e for e in EXAMPLES if e.lang in RUN and not e.runs]


def test_every_fence_says_how_it_runs():
    unknown = [f"{e.where} ```{' '.join(e.words)}" for e in EXAMPLES if e.lang not in RUN | NOT_RUN]
    assert not unknown, f"fences of no known kind (see docs/README.md): {unknown}"


def test_there_are_examples_of_each_kind():
    kinds = {(e.lang, e.runs) for e in EXAMPLES}
    assert {("python", True), ("ipython", True), ("python", False)} <= kinds


@pytest.mark.parametrize("example", PARSED, ids=lambda e: e.where)
def test_example_not_run_parses(example):
    from IPython.core.inputtransformer2 import TransformerManager

    cells = example.cells or [Cell(example.source, example.line + 1)]
    for cell in cells:
        source = cell.source
        if example.lang == "ipython":
            source = TransformerManager().transform_cell(source)
        compile(source, f"{example.page}:{cell.line}", "exec")


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_script(example: Example) -> None:
    with tempfile.TemporaryDirectory(prefix="docs-example-") as tmp:
        Path(tmp, "example.py").write_text(example.source)
        proc = subprocess.Popen(
            [sys.executable, "example.py"],
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "MPLBACKEND": "Agg"},
        )
        try:
            out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill(proc)
            pytest.fail(f"{example.where}: still running after {SCRIPT_TIMEOUT} s")
    assert proc.returncode == 0 and not FAILED.search(out), (
        f"{example.where} exited {proc.returncode}:\n{out[-4000:]}"
    )


# Runs in the page's own interpreter: a real IPython shell reading cells (JSON lines) on stdin
# and answering on the descriptor in argv[1], so that what the cells print stays apart.
SHELL = r"""
import json, os, sys
from IPython.core.interactiveshell import InteractiveShell

answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
shell = InteractiveShell.instance(colors="nocolor")  # plain tracebacks for the failure message
for line in sys.stdin:
    cell = json.loads(line)
    print(f"--- {cell['where']}", flush=True)
    result = shell.run_cell(cell["source"], store_history=True)
    sys.stdout.flush()
    sys.stderr.flush()
    error = result.error_before_exec or result.error_in_exec
    answers.write(json.dumps({
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "repr": repr(result.result),
    }) + "\n")
nb = sys.modules.get("monarch_nb")
ctl = nb.current() if nb is not None else None
if ctl is not None and not ctl.closed:
    ctl.down()
"""


class PageShell:
    """One page's IPython shell, in a process and a temporary directory of its own."""

    def __init__(self, page: str):
        self.page = page
        self.tmp = tempfile.TemporaryDirectory(prefix="docs-page-")
        self.log = open(Path(self.tmp.name, "shell.log"), "a+")  # noqa: SIM115 (closed in close)
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SHELL, str(write)],
            cwd=self.tmp.name,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(write,),
            start_new_session=True,
            env={**os.environ, "MPLBACKEND": "Agg"},
        )
        os.close(write)
        self.answers = os.fdopen(read)
        self.done: set[int] = set()  # lines of the fences run
        self.failed: str | None = None  # where a cell failed: the later ones would only mislead

    def _printed(self, since: int) -> str:
        self.log.flush()
        self.log.seek(since)
        return self.log.read()[-4000:]

    def run(self, example: Example) -> None:
        if self.failed:
            pytest.fail(f"{example.where}: not run, as the page's cell at {self.failed} failed")
        for cell in example.cells:
            where = f"{example.page}:{cell.line}"
            self.failed = where
            start = self.log.seek(0, os.SEEK_END)
            self.proc.stdin.write(json.dumps({"source": cell.source, "where": where}) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.answers], [], [], CELL_TIMEOUT)
            line = self.answers.readline() if ready else ""
            if not line:
                why = f"still running after {CELL_TIMEOUT} s" if not ready else "the shell exited"
                printed = self._printed(start)
                self.close(kill=True)
                pytest.fail(f"{where}: {why}:\n{printed}")
            answer = json.loads(line)
            assert answer["error"] is None, (
                f"{where} raised {answer['error']}:\n{self._printed(start)}"
            )
            if cell.out is not None:
                assert answer["repr"] == cell.out, (
                    f"{where}: the page shows Out {cell.out}, the cell returned {answer['repr']}"
                )
            self.failed = None
        self.done.add(example.line)

    def close(self, kill: bool = False) -> str:
        """End the shell (its cluster shut down first); what it printed while ending."""
        if self.log.closed:
            return ""
        start = self.log.seek(0, os.SEEK_END)
        if kill:
            _kill(self.proc)
        else:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=CELL_TIMEOUT)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        printed = self._printed(start)
        self.answers.close()
        self.log.close()
        self.tmp.cleanup()
        return printed


@pytest.fixture(scope="module")
def shells():
    open_shells: dict[str, PageShell] = {}
    yield open_shells
    for shell in open_shells.values():
        shell.close()


def _shell_for(shells: dict[str, PageShell], page: str) -> PageShell:
    for other in [p for p in shells if p != page]:
        shells.pop(other).close()  # one page's cluster at a time
    if page not in shells:
        shells[page] = PageShell(page)
    return shells[page]


@pytest.mark.parametrize("example", RUNS, ids=lambda e: e.where)
def test_example_runs(example, shells):
    if example.lang == "python":
        _run_script(example)
        return
    shell = _shell_for(shells, example.page)
    page_cells = [e for e in RUNS if e.page == example.page and e.lang == "ipython"]
    for earlier in page_cells:
        if earlier.line < example.line and earlier.line not in shell.done:
            shell.run(earlier)  # deselected, but this one builds on it
    shell.run(example)
    if example is page_cells[-1]:
        proc = shells.pop(example.page)
        printed = proc.close()
        assert proc.proc.returncode == 0 and not FAILED.search(printed), (
            f"{example.page}: the shell did not end cleanly after its last cell "
            f"(exit {proc.proc.returncode}):\n{printed}"
        )


# -- paths and links ------------------------------------------------------------------------
_PATH = re.compile(r"`((?:monarch_nb|tests|benchmarks|notebooks|kernels|docs|extension)/[^`\s]*)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^(\s*)(`{3,}).*?^\s*\2\s*$", "", path.read_text(), flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's ids for the headings of a page."""
    ids = set()
    for heading in re.findall(r"^#+ (.*)$", _prose(path), re.M):
        text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
        ids.add(text.replace(" ", "-"))
    return ids


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_links_exist(page):
    text = _prose(page)
    missing = []
    for name in _PATH.findall(text):
        sketch = any(c in name for c in "<*{") or "..." in name  # a pattern, not a path
        if not sketch and not (ROOT / name.rstrip("/")).exists():
            missing.append(name)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        where = (page.parent / file) if file else page
        known = not anchor or where.suffix != ".md" or anchor in _anchors(where)
        if not where.exists() or not known:
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} names what is not there: {missing}"
