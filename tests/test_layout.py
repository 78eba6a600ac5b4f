"""The house rules the layout keeps: folders say which process runs a file, folders import only
downward, the import graph has no cycles, and no file grows past what a reader takes in at
once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "monarch_nb"
# Imported by every side; everything else lives in the folder of the process that runs it.
SHARED = {"__init__.py", "errors.py", "kept.py", "registry.py", "wire.py"}
# PyTorch Monarch's module names (monarch_nb.actor, monarch_nb.rdma): like the package's own
# __init__, above every folder, exporting their names.
FACADES = {"actor.py", "rdma.py"}
# The folders, lowest first (docs/architecture.md draws them): a module imports from its own
# folder and from those of the levels before its own, never from a later level or from another
# folder of its own level, type hints included. ``shared`` is SHARED's modules; the package's
# own __init__ is above every level.
LEVELS = [
    ("shared",),
    ("rank", "telemetry", "relay"),
    ("dispatch",),
    ("controller",),
    ("host", "actors"),
    ("notebook",),
    ("server", "examples"),
]
SIDES = {folder for level in LEVELS[1:] for folder in level}
MAX_LINES = 500


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _imports(path: Path, hints: bool = False) -> set[str]:
    """The package's modules that ``path`` imports, at the top or inside functions (a lazy
    import is still a dependency), and those only a type checker sees where ``hints``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child) and not hints:
                continue
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("monarch_nb"):
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").exists() or (
                        ROOT / sub.replace(".", "/")
                    ).is_dir()
                    found.add(sub if is_module else child.module)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("monarch_nb"))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None (a package's ``__init__`` importing its own modules is not one:
    Python runs the package first either way)."""
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if node.startswith(dep + "."):
                continue  # a module importing its own package's __init__
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep in graph and state.get(dep) is None and (found := walk(dep, [*path, dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if state.get(start) is None and (found := walk(start, [start])):
            return found
    return None


def _folder(module: str) -> str:
    """The folder of LEVELS that ``module`` is in (``monarch_nb`` itself: the package's top)."""
    parts = module.split(".")
    if len(parts) == 1 or f"{parts[1]}.py" in FACADES:
        return "monarch_nb"
    return "shared" if f"{parts[1]}.py" in SHARED else parts[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes to a folder not below its own: ``module -> imported``."""
    level = {folder: n for n, folders in enumerate(LEVELS) for folder in folders}
    wrong = []
    for module, deps in sorted(graph.items()):
        here = _folder(module)
        if here == "monarch_nb":
            continue  # the package's __init__: above every folder, it exports their names
        for dep in sorted(deps):
            there = _folder(dep)
            if there != here and level.get(there, len(LEVELS)) >= level[here]:
                wrong.append(f"{module} ({here}) -> {dep} ({there})")
    return wrong


def test_no_import_cycles():
    graph = {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    # A package's __init__ re-exports its modules; those edges point down, never back.
    graph = {
        mod: {d for d in deps if not d.startswith(mod + ".")}
        if (ROOT / mod.replace(".", "/")).is_dir()
        else deps
        for mod, deps in graph.items()
    }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_folders_import_only_downward():
    graph = {_module(p): _imports(p, hints=True) for p in PACKAGE.rglob("*.py")}
    wrong = _upward(graph)
    assert not wrong, "imports from a folder above (or beside) the importer's:\n" + "\n".join(wrong)


def test_the_checker_finds_an_upward_import(tmp_path):
    lazy_and_hinted = tmp_path / "m.py"
    lazy_and_hinted.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from monarch_nb.notebook.magic import load\n"
        "def f():\n"
        "    from monarch_nb.actors import mesh\n"
    )
    found = _imports(lazy_and_hinted, hints=True)
    assert found == {"monarch_nb.notebook.magic", "monarch_nb.actors.mesh"}
    assert _imports(lazy_and_hinted) == {"monarch_nb.actors.mesh"}
    graph = {
        "monarch_nb.controller.lifecycle": found,
        "monarch_nb.rank.engine": {"monarch_nb.telemetry.metrics", "monarch_nb.wire"},
        "monarch_nb.errors": {"monarch_nb.controller.controller"},
        "monarch_nb.notebook.magic": {"monarch_nb.controller.start", "monarch_nb.errors"},
        "monarch_nb": {"monarch_nb.notebook.magic"},
    }
    assert _upward(graph) == [
        "monarch_nb.controller.lifecycle (controller) -> monarch_nb.actors.mesh (actors)",
        "monarch_nb.controller.lifecycle (controller) -> monarch_nb.notebook.magic (notebook)",
        "monarch_nb.errors (shared) -> monarch_nb.controller.controller (controller)",
        "monarch_nb.rank.engine (rank) -> monarch_nb.telemetry.metrics (telemetry)",
    ]


def test_every_module_sits_in_the_folder_of_its_process():
    stray = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if (p.parent == PACKAGE and p.name not in SHARED | FACADES)
        or (p.parent != PACKAGE and p.relative_to(PACKAGE).parts[0] not in SIDES)
    ]
    assert not stray, f"modules outside the layout of docs/architecture.md: {stray}"


@pytest.mark.parametrize(
    "folder", ["monarch_nb", "kernels/monarch_kernels", "benchmarks", "extension/src"]
)
def test_no_file_is_too_long(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*")
        if p.suffix in {".py", ".ts", ".tsx"} and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_readme_is_a_front_page():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; reference material belongs in docs/"
