"""The house rules the layout keeps: folders say which process runs a file, the import graph has
no cycles, and no file grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "monarch_nb"
# Imported by every side; everything else lives in the folder of the process that runs it.
SHARED = {"__init__.py", "errors.py", "kept.py", "registry.py", "wire.py"}
SIDES = {"controller", "notebook", "rank", "actors", "telemetry", "server", "examples", "host"}
MAX_LINES = 500


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at the top or inside functions (a lazy
    import is still a dependency), but not those only a type checker sees."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
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


def test_every_module_sits_in_the_folder_of_its_process():
    stray = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if (p.parent == PACKAGE and p.name not in SHARED)
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
