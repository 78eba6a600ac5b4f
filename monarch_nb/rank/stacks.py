"""Every thread's stack in this worker process, for ``%monarch stacks`` (controller/stacks.py).

Collected on the worker's event loop, where interrupt and info are answered too: the rank's own
thread may wait in a C call (a collective, ``time.sleep``) and could not answer. ``native``
asks py-spy for the C frames as well; that takes a second or more, so the event loop answers
"answered" at once (the controller then knows the rank is alive) and a thread of its own sends
the stacks when py-spy is done.

A stack travels as frames ``[file, line, function, source line, native]``, outermost first,
with the leading frames that are the worker's machinery (threading's bootstrap, the engine's
loop) cut off: what is left starts at the user's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import linecache
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import traceback
from typing import Any

from monarch_nb.rank import shell as rank_shell
from monarch_nb.rank.cells import CELL_PREFIX

HOW_TO_GET = "pip install 'monarch-nb[stacks]'"
NATIVE_TIMEOUT = 20.0  # seconds for py-spy to read the process
ACTOR_PREFIX = "monarch-actor-"  # actors/worker.py names each actor's thread so

_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE = f"{os.sep}site-packages{os.sep}"
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.realpath(path)) + os.sep if path else None


# Packages whose threads are the worker's own: a thread with only their frames (and the
# standard library's) is machinery, not something the user started.
_MACHINERY = [
    d
    for d in map(_package_dir, ("monarch_nb", "distributed", "tornado", "dask", "zict"))
    if d is not None
]


def answer(engine, channel, msg: dict[str, Any]) -> None:
    """On the worker's event loop: reply to a stacks request ``msg``."""
    info = engine.info()
    if not msg.get("native"):
        report = collect(engine, info.get("collectives"))
        channel.reply(
            {"ev": "done", "id": msg["id"], "status": "ok", "stacks": report, "info": info}
        )
        return
    channel.reply({"ev": "answered", "id": msg["id"], "info": info})
    threading.Thread(
        target=_answer_native,
        args=(engine, channel, msg["id"], info),
        name="monarch-stacks",
        daemon=True,
    ).start()


def _answer_native(engine, channel, request_id: str, info: dict[str, Any]) -> None:
    note = None
    try:
        native = py_spy_dump(os.getpid())
    except NativeUnavailable as e:
        native, note = None, f"{e}; Python frames only"
    report = collect(engine, info.get("collectives"), native)
    if note:
        report["note"] = note
    channel.reply({"ev": "done", "id": request_id, "status": "ok", "stacks": report, "info": info})


def collect(engine, count: int | None, native: dict[int, list] | None = None) -> dict[str, Any]:
    """The stacks of every thread of this process, and which collective the rank waits in.
    ``count``: the collectives the rank has called on its default group (-1: no group);
    ``native``: py-spy's frames by thread id, used in place of Python's where present."""
    here = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    engine_thread = getattr(getattr(engine, "_thread", None), "ident", None)
    running = getattr(engine, "_current", None) is not None
    loops = _loops(engine)
    threads, where = [], None
    for ident, frame in sys._current_frames().items():
        frames = (native or {}).get(ident) or _python_frames(frame)
        name = names.get(ident, f"thread {ident}")
        kind, actor = _kind(ident, name, frames, here, engine_thread, running)
        # a thread in its loop's select, with no code of the user's running: its tasks wait
        idle = not any(_is_user(f) for f in frames)
        tasks = _awaiting(loops.get(ident)) if kind in ("cell", "actor") and idle else []
        start = _user_start(frames, kind, bool(tasks))
        shown = [f for f in frames[start:] if f[0] != rank_shell.__file__]
        cell = next((i for i, f in enumerate(shown) if f[0].startswith(CELL_PREFIX)), None)
        if kind == "cell":
            where = _where(shown) or next(filter(None, map(_where, tasks)), None)
        threads.append(
            {
                "name": name,
                "kind": kind,
                "actor": actor,
                "frames": [_short(f) for f in shown],
                "cell": cell if kind == "cell" else None,
                "tasks": [[_short(f) for f in task] for task in tasks],
                "collective": _collective(frame, count) if kind != "worker" else None,
            }
        )
    # the cell's collective first: it is the one the other ranks' cells wait for
    threads.sort(key=lambda t: t["kind"] != "cell")
    return {
        "threads": threads,
        "collective": next((t["collective"] for t in threads if t["collective"]), None),
        "count": count,
        "where": where,
        "running": running,
        "since": getattr(engine, "_started_at", None),
        "native": native is not None,
    }


def _python_frames(frame) -> list[list]:
    return [
        [f.filename, f.lineno, f.name, f.line or "", False] for f in traceback.extract_stack(frame)
    ]


def _kind(ident, name, frames, here, engine_thread, running) -> tuple[str, str | None]:
    """(kind, actor name): "cell" (the rank's thread running a cell or call), "actor", "thread"
    (one the user's code or a library started) or "worker" (the worker's own machinery, the
    rank's thread between cells, and this one)."""
    if ident == engine_thread:
        return ("cell" if running else "worker"), None
    if name.startswith(ACTOR_PREFIX):
        return "actor", name[len(ACTOR_PREFIX) :]
    if ident == here or not any(_is_user(f) for f in frames):
        return "worker", None
    return "thread", None


def _is_user(frame: list) -> bool:
    """Whether a frame is code of the user's or of a library they use (torch): neither the
    standard library, nor the worker's machinery, nor a C frame."""
    return not frame[4] and _user_file(frame[0])


@functools.lru_cache(maxsize=4096)  # realpath stats each part of the path; asked per frame
def _user_file(filename: str) -> bool:
    if filename.startswith(CELL_PREFIX):
        return True
    if filename.startswith("<"):
        # <frozen importlib._bootstrap> and a spawned worker's <string> are Python's; code
        # made at run time is the user's (<dynamic-code>: a function sent by value)
        return not (filename.startswith("<frozen ") or filename == "<string>")
    path = os.path.realpath(filename)
    if path.startswith(_STDLIB) and _SITE not in path:
        return False
    return not any(path.startswith(d) for d in _MACHINERY)


def _user_start(frames: list[list], kind: str, tasks: bool = False) -> int:
    """Where the user's code starts: an actor without any is idle (no frames), as is a thread
    whose loop only waits for its tasks (shown apart); the worker's own threads, and a call of
    monarch-nb's own on the rank's thread, are shown whole."""
    if kind == "worker":
        return 0
    default = len(frames) if kind == "actor" or tasks else 0
    return next((i for i, f in enumerate(frames) if _is_user(f)), default)


def _loops(engine) -> dict[int, Any]:
    """thread id -> the asyncio loop that thread runs user coroutines on: the rank's thread
    (a cell with top-level ``await``) and each actor's (its ``async def`` endpoints)."""
    loops = {}
    thread = getattr(engine, "_thread", None)
    if thread is not None and getattr(engine, "_aloop", None) is not None:
        loops[thread.ident] = engine._aloop
    host_module = sys.modules.get("monarch_nb.actors.worker")  # loaded once an actor exists
    host = host_module.current_host() if host_module is not None else None
    for runner in list(getattr(host, "actors", {}).values()):
        loops[runner._thread.ident] = runner.loop
    return loops


def _awaiting(loop) -> list[list[list]]:
    """The stacks of the tasks suspended on ``loop``, each outermost first: where each
    coroutine awaits. Read from another thread: the coroutines are not running (their thread
    waits in its loop's select), and all_tasks copies the task set before iterating."""
    if loop is None or loop.is_closed():
        return []
    stacks = []
    try:
        tasks = asyncio.all_tasks(loop)
    except RuntimeError:  # the set changed under us too often: the thread is busy, not waiting
        return []
    for task in tasks:
        frames, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                break
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno).strip()
            frames.append([code.co_filename, frame.f_lineno, code.co_name, line, False])
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        user = [f for f in frames[_user_start(frames, "actor") :] if f[0] != rank_shell.__file__]
        if user:
            stacks.append(user)
    return sorted(stacks)


def _collective(frame, count: int | None) -> dict[str, Any] | None:
    """The torch.distributed collective this thread waits in, with its number: the outermost
    public function of distributed_c10d on the stack (``all_gather_object`` rather than the
    ``all_gather`` it calls). A rank's count goes up as a collective starts, so the number of
    the one it waits in is its count now (of its group's, where the call names a group)."""
    outermost = None
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith(_C10D) and not code.co_name.startswith("_"):
            outermost = f
        f = f.f_back
    if outermost is None:
        return None
    n = count
    group = _group_of(outermost)
    if group is not None:
        # a backend without the count: the default group's stands
        with contextlib.suppress(Exception):
            n = group._get_sequence_number_for_group()
    return {"name": outermost.f_code.co_name, "n": n}


def _group_of(frame):
    """The process group a c10d call names (None: the default group). The frame's locals are
    read from another thread: a snapshot, the GIL held."""
    try:
        return frame.f_locals.get("group")
    except Exception:
        return None


def _where(frames: list[list]) -> str | None:
    """``data.py:88``: the innermost frame of the user's own code (not a library's)."""
    for f in reversed(frames):
        if f[0].startswith(CELL_PREFIX):
            return f"cell {f[0][len(CELL_PREFIX) : -1]}, line {f[1]}"
        if not f[4] and not f[0].startswith("<") and "site-packages" not in f[0] and _is_user(f):
            return f"{os.path.basename(f[0])}:{f[1]}"
    return None


def _short(frame: list) -> list:
    """A frame with its file named as a traceback reader knows it: from the package on for
    installed code (``torch/distributed/...``), from the library for the standard one."""
    filename = frame[0]
    if _SITE in filename:
        filename = filename.rsplit(_SITE, 1)[1]
    elif filename.startswith(_STDLIB):
        filename = filename[len(_STDLIB) :]
    return [filename, *frame[1:]]


# -- py-spy: the C frames ----------------------------------------------------------------------
class NativeUnavailable(RuntimeError):
    """py-spy is not here, or could not read this process; says which, in one line."""


def py_spy_dump(pid: int) -> dict[int, list]:
    """py-spy's stacks of process ``pid`` with C frames, by thread id, outermost first."""
    exe = _py_spy()
    if exe is None:
        raise NativeUnavailable(f"--native needs py-spy on the ranks: {HOW_TO_GET}")
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--native", "--json"],
            capture_output=True,
            text=True,
            timeout=NATIVE_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"py-spy did not finish in {NATIVE_TIMEOUT:g} s") from None
    except OSError as e:
        raise NativeUnavailable(f"py-spy could not start: {e}") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        # "Error: ..." then its causes and, where RUST_BACKTRACE is set, a backtrace
        why = next((ln[len("Error: ") :] for ln in lines if ln.startswith("Error: ")), None)
        why = why or (lines[0] if lines else f"exit status {done.returncode}")
        denied = "ermission denied" in done.stderr or "not permitted" in done.stderr
        hint = " (py-spy needs ptrace: root, or kernel.yama.ptrace_scope=0)" if denied else ""
        raise NativeUnavailable(f"py-spy could not read the worker process: {why}{hint}")
    try:
        threads = json.loads(done.stdout)
    except ValueError:
        raise NativeUnavailable("py-spy's output was not the JSON expected") from None
    return {t["thread_id"]: _py_spy_frames(t["frames"]) for t in threads}


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv not on PATH
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def _py_spy_frames(frames: list[dict]) -> list[list]:
    out = []
    for f in reversed(frames):  # py-spy lists the innermost first
        native = f.get("module") is not None
        if native and f["name"].startswith("0x"):  # an address without a symbol says nothing
            continue
        line = f.get("line") or 0
        text = "" if native else linecache.getline(f["filename"], line).strip()
        name = _short_symbol(f["name"]) if native else f["name"].rsplit(".", 1)[-1]
        filename = f.get("short_filename", f["filename"]) if native else f["filename"]
        out.append([filename, line, name, text, native])
    return out


def _short_symbol(name: str, limit: int = 100) -> str:
    """A C++ symbol without its template arguments and parameter lists, which run to
    kilobytes (pybind11's): ``pybind11::cpp_function::initialize<>()::{lambda()#1}::_FUN``."""
    out, stack = [], []
    for ch in name:
        if ch in "<(":
            if not stack:
                out.append(ch)
            stack.append(ch)
        elif stack and ch == {"<": ">", "(": ")"}[stack[-1]]:
            stack.pop()
            if not stack:
                out.append(ch)
        elif not stack:
            out.append(ch)
    short = "".join(out) if not stack else name  # unbalanced (operator<): left as it is
    return short if len(short) <= limit else short[: limit - 1] + "…"
