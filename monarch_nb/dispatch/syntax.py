"""A cell's IPython syntax turned into the Python the ranks run, before anything is sent.

``!nvidia-smi``, ``files = !ls {path}``, ``%time step()``, ``%%bash`` on a cell's first line:
IPython's own transformer rewrites them into calls on ``get_ipython()``, which on a rank is the
rank's shell (rank/shell.py). A magic the ranks do not have is refused here, in one line,
so the cell never half-runs. Cells without IPython syntax (nearly all) pass through untouched
and without the transformer's cost.

``parse`` is the one place a cell is parsed on the controller: the magic asks it whether the
cell ends in an expression and hands the ``ParsedCell`` to ``Controller.run``, which sends it
as it is (the rank compiles the text once more, in its own process).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from monarch_nb.rank.shell import CELL_MAGICS, LINE_MAGICS, available

# A line that could hold IPython syntax: ``!cmd``, ``%magic``, ``x = !cmd``, ``x = %magic``,
# ``name?`` help, a pasted prompt; or a cell indented as a whole. Only such cells are
# transformed; the transformer itself decides (a ``!`` in a string is left alone).
_MAYBE_IPYTHON = re.compile(r"^\s*([!%]|[\w.\[\], ]+=\s*[!%])|\?\s*$|^\s*(>>>|\.\.\.|In \[)", re.M)

_HELP = ("pinfo", "pinfo2", "psearch")


class UnavailableMagic(ValueError):
    """The cell uses a magic the ranks do not have; nothing was sent."""


@dataclass(frozen=True)
class ParsedCell:
    """A cell parsed on the controller: ``python`` is what the ranks run, ``source`` what was
    written (the ranks show its lines in tracebacks where the two differ)."""

    source: str
    python: str
    ends_in_expression: bool  # the last statement is an expression: the cell has a value


def parse(cell: str) -> ParsedCell:
    """The cell as Python, parsed once: IPython's syntax rewritten, line numbers kept (leading
    blank lines too) so that tracebacks point at the cell's own lines. Raises UnavailableMagic
    for a magic the ranks lack, SyntaxError where the cell does not parse (null bytes too).
    A cell run again (a loop of ``ctl.run("step()")``) is parsed once."""
    parsed = _parsed.get(cell)
    if parsed is None:
        parsed = _parse(cell)
        if len(_parsed) >= PARSED_KEPT:
            _parsed.pop(next(iter(_parsed)))
        _parsed[cell] = parsed
    return parsed


PARSED_KEPT = 256  # the cells whose parse is kept, the oldest forgotten first
_parsed: dict[str, ParsedCell] = {}


def _parse(cell: str) -> ParsedCell:
    python = _rewrite(cell)
    try:
        tree = ast.parse(python, "<cell>")
    except ValueError as e:  # null bytes: Python 3.11 raises ValueError, 3.12 SyntaxError
        if "\0" not in python:
            raise
        where = python[: python.find("\0")].count("\n") + 1
        line = python.splitlines()[where - 1]
        raise SyntaxError(str(e), ("<cell>", where, 1, line)) from None
    if python is not cell:
        _check_magics(tree)
    body = tree.body
    return ParsedCell(cell, python, bool(body) and isinstance(body[-1], ast.Expr))


def _rewrite(cell: str) -> str:
    """The cell with IPython's syntax rewritten into Python; ``cell`` itself where it has none."""
    first = next((line for line in cell.splitlines() if line.strip()), "")
    if not _MAYBE_IPYTHON.search(cell) and not first[:1].isspace():
        return cell
    from IPython.core.inputtransformer2 import TransformerManager

    body = cell.lstrip("\n \t")
    lead = cell[: len(cell) - len(body)]
    blank = lead[: lead.rfind("\n") + 1]  # whole blank lines; an indent stays with its line
    code = blank + TransformerManager().transform_cell(cell[len(blank) :])
    if code.rstrip("\n") == cell.rstrip("\n"):  # nothing of IPython's after all (``# why?``)
        return cell
    return code


def _check_magics(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        magic = _magic_call(node)
        if magic is None:
            continue
        kind, name = magic
        if kind == "run_line_magic" and name in _HELP:
            raise UnavailableMagic(
                "help (name? or name??) is not available in a %%monarch cell: "
                "use help(name) there, or name? in a cell of the notebook's own"
            )
        if kind == "run_line_magic" and name.startswith("%"):
            raise UnavailableMagic(
                f"%{name} is a cell magic: it goes on the cell's first line, under %%monarch"
            )
        if name == "monarch":
            raise UnavailableMagic(
                "%monarch runs in the notebook, not on the ranks: give it a cell of its own"
            )
        line = kind == "run_line_magic"
        if name not in (LINE_MAGICS if line else CELL_MAGICS):
            written = ("%" if line else "%%") + name
            raise UnavailableMagic(f"{written} is not available on the ranks; {available()}")


def _magic_call(node: ast.AST) -> tuple[str, str] | None:
    """("run_line_magic" or "run_cell_magic", name) for ``get_ipython().run_*_magic('name',
    ...)`` with the name written out, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    owner = node.func.value
    if not (
        node.func.attr in ("run_line_magic", "run_cell_magic")
        and isinstance(owner, ast.Call)
        and isinstance(owner.func, ast.Name)
        and owner.func.id == "get_ipython"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return None
    return node.func.attr, node.args[0].value
