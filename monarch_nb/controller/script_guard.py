"""Refusing ``up()`` from a script's unguarded top level, before any worker starts.

Dask starts each worker process by spawn (``distributed.worker.multiprocessing-method``), and
a spawned process runs the ``__main__`` script again, as the module ``__mp_main__``. A script
that calls ``up()`` at its top level, outside ``if __name__ == "__main__":``, would have every
new worker start workers of its own; multiprocessing stops each, and the nannies print a
cascade of tracebacks. So ``up()`` looks at who called it: the script's top-level line being
run, read against the script's syntax tree.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from types import FrameType

from monarch_nb.errors import ClusterError

_REEXECUTING = ("spawn", "forkserver")  # the start methods that import the script again


def check_caller() -> None:
    """Raise a one-line ClusterError where ``up()`` is reached from the main script's top level
    outside its ``__main__`` guard (workers started by spawn or forkserver), or from a spawned
    process importing that script (``__mp_main__``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frames = _frames()
    for frame in frames:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise ClusterError(_message(frame, "while a process it started imports it again"))
    if not path or not str(path).endswith(".py") or _method() not in _REEXECUTING:
        return  # an interactive session or a notebook: nothing imports it again
    path = os.path.abspath(path)
    mine = [f for f in frames if os.path.abspath(f.f_code.co_filename) == path]
    top = [f for f in mine if f.f_code.co_name == "<module>"]
    if not top:
        return  # not on the way from the script's top level (a thread it started, say)
    guarded = _guarded_lines(path)
    if guarded is None:
        return  # the script cannot be read or parsed here: assume it is guarded
    if not any(lo <= f.f_lineno <= hi for f in mine for lo, hi in guarded):
        raise ClusterError(_message(top[0], "which every worker process runs again as it starts"))


def _frames() -> list[FrameType]:
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _method() -> str:
    """How ``up``'s workers will start: from the forkserver where that is on (importing
    Distributed here to learn Dask's own choice would hold up its start by half a second)."""
    from monarch_nb.controller import forkserver

    if forkserver.enabled():
        return "forkserver"
    import dask
    import distributed  # noqa: F401 (its defaults enter dask's config on import)

    return dask.config.get("distributed.worker.multiprocessing-method", "spawn")


def _message(frame: FrameType, what: str) -> str:
    where = f"{os.path.basename(frame.f_code.co_filename)} (line {frame.f_lineno})"
    return (
        f"monarch_nb.up() is called at the top level of {where}, {what} (by spawn); "
        'put the code that starts the cluster under `if __name__ == "__main__":`'
    )


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges that run only when the file is ``__main__``, or None if unreadable."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (branch := _main_branch(node)):
            ranges.append((branch[0].lineno, branch[-1].end_lineno or branch[-1].lineno))
    return tuple(ranges)


def _main_branch(node: ast.If) -> list[ast.stmt] | None:
    """The statements of ``if __name__ == "__main__":`` (or of the ``else`` of ``!=``)."""
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    sides = {_name(test.left), _name(test.comparators[0])}
    if sides != {"__name__", "'__main__'"}:
        return None
    if isinstance(test.ops[0], ast.Eq):
        return node.body
    if isinstance(test.ops[0], ast.NotEq):
        return node.orelse or None
    return None


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and node.value == "__main__":
        return "'__main__'"
    return None
