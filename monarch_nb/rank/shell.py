"""IPython's syntax on a rank: ``!cmd``, ``files = !ls``, and the magics that make sense there.

The controller turns a cell's IPython syntax into Python with IPython's own transformer
(syntax.py), which writes calls such as ``get_ipython().system('nvidia-smi')``. On a rank,
``get_ipython()`` is the rank's RankShell: it runs shell commands with the rank's output and
interrupt, expands ``{name}`` and ``$name`` from the rank's namespace as IPython does, and
carries the magics listed in LINE_MAGICS and CELL_MAGICS. Other magics act on the notebook's
own kernel (``%matplotlib``, ``%run``, ``%debug``...), and syntax.py refuses them before
anything is sent.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import timeit as timeit_module
import zlib
from collections.abc import Callable
from typing import Any

from monarch_nb.rank import children

# The magics a rank has, by name: a line magic gets (shell, line, frame), a cell magic
# (shell, line, cell, frame); frame is the cell's, for its namespace and line numbers.
LINE_MAGICS: dict[str, Callable[..., Any]] = {}
CELL_MAGICS: dict[str, Callable[..., Any]] = {}


def _line_magic(name: str, expands: bool = True):
    """Register a line magic; ``expands=False``: its line reaches it without ``{name}`` and
    ``$name`` filled in (Python code, as IPython leaves %time's)."""

    def register(fn):
        fn.expands = expands
        LINE_MAGICS[name] = fn
        return fn

    return register


def _cell_magic(name: str):
    def register(fn):
        CELL_MAGICS[name] = fn
        return fn

    return register


class RankShell:
    """What ``get_ipython()`` returns in a rank's cells (the ``system``, ``getoutput``,
    ``run_line_magic`` and ``run_cell_magic`` that IPython's transformed cells call)."""

    def __init__(self, namespace: dict[str, Any]):
        self.user_ns = namespace
        self._previous_dir: str | None = None

    def get_ipython(self) -> RankShell:
        return self

    def var_expand(self, cmd: str, depth: int = 0) -> str:
        """``{expr}`` and ``$name`` in ``cmd`` filled from the rank's namespace and the locals
        ``depth`` frames above the caller; left as written where they do not format."""
        from IPython.utils.text import DollarFormatter

        ns = dict(self.user_ns)
        ns.update(sys._getframe(depth + 1).f_locals)
        try:
            return DollarFormatter().vformat(cmd, args=[], kwargs=ns)
        except Exception:
            return cmd

    def system(self, cmd: str) -> None:
        """``!cmd``: run it in the shell, its output streamed as the rank's; the exit status
        in ``_exit_code``."""
        cmd = self.var_expand(cmd, depth=1)
        if cmd.rstrip().endswith("&"):
            # The cell would wait for the background process's output to end, as Jupyter's
            # kernel would; it refuses such commands too.
            raise OSError(
                "background processes are not supported in !cmd (as in Jupyter); start one "
                "with subprocess.Popen(...)"
            )
        self.user_ns["_exit_code"] = children.run(cmd)

    def getoutput(self, cmd: str, split: bool = True, depth: int = 0):
        """``x = !cmd``: the command's output (stdout and stderr together), as IPython's SList
        of lines (``split=False``: one LSString)."""
        from IPython.utils.text import LSString, SList

        cmd = self.var_expand(cmd, depth=depth + 1)
        parts: list[str] = []
        proc = children.start(cmd, merge_stderr=True)
        self.user_ns["_exit_code"] = children.finish(proc, parts.append, parts.append)
        out = "".join(parts)
        return SList(out.splitlines()) if split else LSString(out.rstrip("\n"))

    def run_line_magic(self, magic_name: str, line: str, _stack_depth: int = 1):
        fn = LINE_MAGICS.get(magic_name)
        if fn is None:
            raise _unavailable(f"%{magic_name}")
        frame = sys._getframe(_stack_depth)
        if fn.expands:
            line = self.var_expand(line, _stack_depth)
        return fn(self, line, frame)

    def run_cell_magic(self, magic_name: str, line: str, cell: str):
        fn = CELL_MAGICS.get(magic_name)
        if fn is None:
            raise _unavailable(f"%%{magic_name}")
        frame = sys._getframe(1)
        return fn(self, self.var_expand(line, 1), cell, frame)


def _unavailable(name: str) -> Exception:
    from IPython.core.error import UsageError

    return UsageError(f"{name} is not available on the ranks; {available()}")


def available() -> str:
    """What a rank's cells have of IPython's syntax, in words."""
    line = ", ".join("%" + m for m in sorted(LINE_MAGICS))
    cell = ", ".join("%%" + m for m in sorted(CELL_MAGICS))
    return f"their cells have !cmd, {line}, and on a first line {cell}"


# A %timeit option at the start of its line: -q, -o, -n 10, -n10.
_OPTION = re.compile(r"-(?P<key>[a-zA-Z])(?:\s*(?P<value>\d+))?(?:\s+|$)")


# -- timing ----------------------------------------------------------------------------------
def _code(source: str, frame, first_line: int):
    """``source`` compiled as statements plus a last expression (None where it ends in a
    statement), under the cell's file name with its line numbers, so a traceback shows the
    cell's own lines."""
    tree = ast.parse(source, frame.f_code.co_filename)
    ast.increment_lineno(tree, first_line - 1)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    name = frame.f_code.co_filename
    body = compile(tree, name, "exec")
    expr = compile(ast.Expression(last.value), name, "eval") if last is not None else None
    return body, expr


def _namespaces(shell: RankShell, frame) -> tuple[dict, dict]:
    """The globals and locals code run by a magic sees: the rank's namespace, and the locals of
    the function the magic was written in (if any)."""
    local = frame.f_locals
    return shell.user_ns, (local if frame.f_globals is not local else shell.user_ns)


def _format_time(seconds: float) -> str:
    if seconds >= 60:
        minutes, s = divmod(seconds, 60)
        return f"{int(minutes)}min {s:.0f}s" if minutes < 60 else f"{minutes / 60:.0f}h"
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6)):
        if seconds * scale >= 1:
            return f"{seconds * scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _time(shell: RankShell, source: str, frame, first_line: int):
    body, expr = _code(source, frame, first_line)
    glob, loc = _namespaces(shell, frame)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        exec(body, glob, loc)
        return eval(expr, glob, loc) if expr is not None else None
    finally:
        wall, cpu = time.perf_counter() - wall0, resource.getrusage(resource.RUSAGE_SELF)
        user, system = cpu.ru_utime - cpu0.ru_utime, cpu.ru_stime - cpu0.ru_stime
        print(
            f"CPU times: user {_format_time(user)}, sys: {_format_time(system)}, "
            f"total: {_format_time(user + system)}\nWall time: {_format_time(wall)}"
        )


@_line_magic("time", expands=False)
def _time_line(shell, line, frame):
    """%time STATEMENT: run it once and print the CPU and wall time; its value if an
    expression."""
    return _time(shell, line, frame, frame.f_lineno)


@_cell_magic("time")
def _time_cell(shell, line, cell, frame):
    return _time(shell, cell, frame, frame.f_lineno + 1)


def _timeit(shell, line: str, cell: str | None, frame):
    """IPython's %timeit: -n loops, -r repeats (7), -p precision (3), -q quiet, -o return
    the result. The loop count, unless given, grows by 10x until a run takes 0.2 s."""
    from IPython.core.error import UsageError
    from IPython.core.magics.execution import TimeitResult

    opts = {"n": 0, "r": 7, "p": 3, "q": False, "o": False}
    rest = line.strip()
    while m := _OPTION.match(rest):
        key, value = m["key"], m["value"]
        if key in ("q", "o") and not value:
            opts[key] = True
        elif key in ("n", "r", "p") and value and int(value) > 0:
            opts[key] = int(value)
        else:
            raise UsageError(
                f"%timeit takes -n N, -r N and -p N (whole numbers > 0), -q and -o; got "
                f"{m[0].strip()!r}"
            )
        rest = rest[m.end() :]
    stmt, setup = (cell, rest or "pass") if cell is not None else (rest, "pass")
    if not stmt.strip():
        raise UsageError("%timeit needs a statement to time: %timeit f(x)")
    glob, loc = _namespaces(shell, frame)
    start = time.perf_counter()
    timer = timeit_module.Timer(stmt, setup, globals={**glob, **loc} if loc is not glob else glob)
    compile_time = time.perf_counter() - start
    number = opts["n"]
    if not number:
        for power in range(10):
            number = 10**power
            if timer.timeit(number) >= 0.2:
                break
    runs = timer.repeat(opts["r"], number)
    per = [t / number for t in runs]
    result = TimeitResult(number, opts["r"], min(per), max(per), runs, compile_time, opts["p"])
    if not opts["q"]:
        print(result)
    return result if opts["o"] else None


@_line_magic("timeit", expands=False)
def _timeit_line(shell, line, frame):
    """%timeit [-n N -r R -p P -q -o] STATEMENT: time it over repeated runs."""
    return _timeit(shell, line, None, frame)


@_cell_magic("timeit")
def _timeit_cell(shell, line, cell, frame):
    return _timeit(shell, line, cell, frame)


# -- the rank's environment ------------------------------------------------------------------
@_line_magic("pip")
def _pip(shell, line, frame):
    """%pip ARGS: pip in the ranks' own Python (``sys.executable -m pip``). The ranks of a
    host share that Python, so they take turns: two pips writing one site-packages at once
    can leave it broken; the second finds the work done."""
    from IPython.core.error import UsageError

    args = shlex.split(line)
    if not args:
        raise UsageError("%pip needs a pip command, for example %pip install einops")
    with pip_turn():
        code = children.run([sys.executable, "-m", "pip", *args])
    if code != 0:
        raise subprocess.CalledProcessError(code, f"pip {line}")
    if args[0] in ("install", "uninstall"):
        print("Note: restart the ranks (%monarch restart) to use updated packages.")


def pip_turn():
    """The turn to run pip in this Python (``sys.prefix``), shared by the processes of a host."""
    return _turn(f"pip-{zlib.crc32(sys.prefix.encode()):08x}")


@contextlib.contextmanager
def _turn(name: str):
    """An exclusive lock shared by the processes of this host (a file lock in the temporary
    directory), waited for in short steps so that an interrupt still lands."""
    path = os.path.join(tempfile.gettempdir(), f"monarch-nb-{name}.lock")
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@_line_magic("cd")
def _cd(shell, line, frame):
    """%cd [DIR]: change the rank process's working directory (no DIR: home; ``-``: the one
    before) and print it."""
    from IPython.core.error import UsageError

    target = line.strip().strip("'\"") or os.path.expanduser("~")
    if target == "-":
        if shell._previous_dir is None:
            raise UsageError("%cd -: no directory to go back to yet")
        target = shell._previous_dir
    target = os.path.expanduser(target)
    before = os.getcwd()
    try:
        os.chdir(target)
    except OSError as e:
        raise UsageError(f"%cd: {e.strerror}: {target}") from None
    shell._previous_dir = before
    print(os.getcwd())


@_line_magic("pwd")
def _pwd(shell, line, frame):
    """%pwd: the rank process's working directory."""
    return os.getcwd()


@_line_magic("env")
def _env(shell, line, frame):
    """%env: the environment; %env NAME: one variable; %env NAME=VALUE or %env NAME VALUE:
    set one."""
    from IPython.core.error import UsageError

    line = line.strip()
    if not line:
        return dict(os.environ)
    if "=" in line.split(None, 1)[0]:
        name, value = line.split("=", 1)
    elif len(line.split(None, 1)) == 2:
        name, value = line.split(None, 1)
    else:
        if line not in os.environ:
            raise UsageError(f"%env: the environment has no {line}")
        return os.environ[line]
    name, value = name.strip(), value.strip()
    if not name.isidentifier():
        raise UsageError(f"%env: {name!r} is not a variable name")
    os.environ[name] = value
    print(f"env: {name}={value}")
    return None


# -- cell magics -----------------------------------------------------------------------------
def _script(program: str):
    def run(shell, line, cell, frame):
        from IPython.core.error import UsageError

        flags = line.split()
        if any(f != "--no-raise-error" for f in flags):
            raise UsageError(f"%%{program} takes only --no-raise-error on the ranks; got {line!r}")
        # The script goes in a file, not down stdin: a long script would fill the pipe while
        # its output filled the other one.
        with tempfile.NamedTemporaryFile("w", suffix=f".{program}", delete=False) as f:
            f.write(cell)
        try:
            code = children.run([program, f.name])
        finally:
            os.unlink(f.name)
        shell.user_ns["_exit_code"] = code
        if code != 0 and not flags:
            raise subprocess.CalledProcessError(code, cell)

    run.__doc__ = f"%%{program}: run the cell as a {program} script, its output the rank's."
    return run


CELL_MAGICS["bash"] = _script("bash")
CELL_MAGICS["sh"] = _script("sh")


@_cell_magic("writefile")
def _writefile(shell, line, cell, frame):
    """%%writefile [-a] FILE: write the cell to FILE on every rank's host (-a appends)."""
    from IPython.core.error import UsageError

    words = shlex.split(line)
    append = bool(words) and words[0] in ("-a", "--append")
    words = words[1:] if append else words
    if len(words) != 1:
        raise UsageError("%%writefile takes a file name (and -a to append): %%writefile train.py")
    path = os.path.expanduser(words[0])
    verb = "Appending to" if append else ("Overwriting" if os.path.exists(path) else "Writing")
    print(f"{verb} {words[0]}")
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        f.write(cell)
