"""Turning a cell into code and an exception into a traceback, for the rank's thread (engine.py).

A cell compiles to its body and, when it ends in an expression, that expression apart: its value
is the cell's result, as in IPython. Tracebacks start at the user's code: the package's own
frames above the cell (the engine, the rank shell) are not shown.
"""

from __future__ import annotations

import ast
import linecache
import os
import traceback
import types
from typing import Any

import cloudpickle

from monarch_nb.rank import shell as rank_shell

CELL_PREFIX = "<monarch cell "
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # monarch_nb/


def compile_cell(
    msg: dict[str, Any],
) -> tuple[types.CodeType, types.CodeType | None, bool]:
    """(the body, the last expression or None, whether its value is hidden) of an execute
    request; top-level ``await`` allowed."""
    code, filename = msg["code"], f"{CELL_PREFIX}{msg.get('n', 0)}>"
    # Tracebacks show the cell as written (``!ls``), not the Python it became.
    source = msg.get("source", code)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    compiled = _compiled.get(code)
    if compiled is None:
        compiled = _compile(code, filename)  # a SyntaxError names this cell
        if len(_compiled) >= COMPILED_KEPT:
            _compiled.pop(next(iter(_compiled)))
        _compiled[code] = compiled
    body, expr = (_named(c, filename) if c is not None else None for c in compiled)
    return body, expr, _ends_in_semicolon(source)


# A cell run again (a loop of ``ctl.run("step()")``) is compiled once: its code objects are
# kept, and each run gets copies named after its own cell number (for tracebacks).
COMPILED_KEPT = 256
_compiled: dict[str, tuple[types.CodeType, types.CodeType | None]] = {}


def _compile(code: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    body = compile(tree, filename, "exec", flags=flags)
    expr = compile(ast.Expression(last.value), filename, "eval", flags=flags) if last else None
    return body, expr


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects inside it (functions, classes, comprehensions) with
    ``filename`` as theirs."""
    consts = tuple(
        _named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def format_error(exc: BaseException) -> dict[str, Any]:
    """``exc`` as the controller shows it: ename, evalue, and the traceback's lines from the
    user's code on."""
    te = traceback.TracebackException.from_exception(exc)
    # The rank shell's own frames (between a cell's %time line and its code) are noise.
    frames = [f for f in te.stack if f.filename != rank_shell.__file__]
    first = next((i for i, f in enumerate(frames) if f.filename.startswith(CELL_PREFIX)), None)
    if first is None:  # a function sent by the controller (apply): from the user's code on
        first = next((i for i, f in enumerate(frames) if not _ours(f.filename)), len(frames))
    frames = frames[first:]
    # Raised by monarch-nb for the user's call (``input()`` with no stdin, ``mesh`` without a
    # mesh): the message says it all, and the trace ends at the user's line.
    while len(frames) > 1 and _ours(frames[-1].filename) and not _ours(frames[0].filename):
        frames.pop()
    if isinstance(exc, KeyboardInterrupt):
        # Where it landed inside our own code (a !cmd's output pump, %monarch run) is
        # noise: the trace ends at the user's line, and is empty for a controller call.
        ours = next((i for i, f in enumerate(frames) if _ours(f.filename)), len(frames))
        frames = frames[:ours]
    te.stack = traceback.StackSummary.from_list(frames)
    lines = "".join(te.format()).rstrip("\n").splitlines()
    evalue = str(exc)
    if isinstance(exc, KeyboardInterrupt) and not evalue:
        evalue = "interrupted"
    return {"ename": type(exc).__name__, "evalue": evalue, "traceback": lines}


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _ends_in_semicolon(code: str) -> bool:
    """Whether the cell's value is hidden: its last token is ``;``, a comment may follow
    (``rank;  # hide``), as IPython decides."""
    if ";" not in code:  # most cells: IPython's tokenizing is a tenth of a trivial cell's trip
        return False
    from IPython.core.displayhook import DisplayHook

    return DisplayHook.semicolon_at_end_of_expression(code)


def plain_error(text: str) -> dict[str, Any]:
    return {"ename": "RuntimeError", "evalue": text, "traceback": []}


def pack(value: Any) -> dict[str, Any]:
    try:
        return {"value": cloudpickle.dumps(value, protocol=5)}
    except Exception as e:
        return {"value_error": f"{type(value).__name__} cannot be pickled: {e}"}
