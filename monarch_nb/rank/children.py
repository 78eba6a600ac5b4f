"""Child processes a rank starts (``%monarch run``'s scripts, a cell's ``!cmd``, ``%pip`` and
``%%bash``): started in a process group of their own, their output copied into the rank's as it
arrives, and stopped, group and all, when the rank is interrupted.

The copy loop wakes every 0.1 s, so an interrupt sent to the rank's thread (an asynchronous
KeyboardInterrupt) lands in Python code even while the child is silent; the caller then stops
the child's whole process group.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

Write = Callable[[str], object]

_running: set[subprocess.Popen] = set()  # started here and not yet waited for
_running_lock = threading.Lock()


def start(
    cmd: str | list[str], env: dict[str, str] | None = None, merge_stderr: bool = False
) -> subprocess.Popen:
    """``cmd`` (a string: in the user's shell, as IPython runs ``!`` commands) in a process
    group of its own inside the worker's session, stdin closed, stdout and stderr piped
    (``merge_stderr``: one pipe)."""
    shell = isinstance(cmd, str)
    proc = subprocess.Popen(
        cmd,
        shell=shell,
        executable=(os.environ.get("SHELL") or None) if shell else None,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        process_group=0,
    )
    with _running_lock:
        _running.add(proc)
    return proc


def run(cmd: str | list[str], env: dict[str, str] | None = None) -> int:
    """``cmd`` to its end, its output the rank's as it arrives; its exit code."""
    return finish(start(cmd, env), sys.stdout.write, sys.stderr.write)


def pump(proc: subprocess.Popen, out: Write, err: Write) -> None:
    """Copy the child's stdout to ``out`` and its stderr to ``err`` (decoded text, as it
    arrives) until both close. A stream the child shares with stdout (``stderr=STDOUT``) or
    does not pipe is skipped."""
    sel = selectors.DefaultSelector()
    for stream, write in ((proc.stdout, out), (proc.stderr, err)):
        if stream is not None:
            sel.register(stream, selectors.EVENT_READ, write)
    decoders = {}
    open_streams = len(sel.get_map())
    while open_streams:
        for key, _ in sel.select(timeout=0.1):
            chunk = os.read(key.fd, 65536)
            dec = decoders.setdefault(key.fd, codecs.getincrementaldecoder("utf-8")("replace"))
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                key.data(dec.decode(b"", final=True))
                continue
            key.data(dec.decode(chunk))
    sel.close()


def finish(proc: subprocess.Popen, out: Write, err: Write) -> int:
    """Pump the child's output until it exits; its exit code. Any exception (an interrupt)
    stops the child first."""
    try:
        pump(proc, out, err)
        return proc.wait()
    except BaseException:
        stop(proc)
        raise
    finally:
        with _running_lock:
            _running.discard(proc)


def terminate_all() -> int:
    """SIGTERM to the process group of every child still running: a script whose peer failed
    waits in a collective, in C, where SIGINT is not acted on (``release.py``); how many."""
    with _running_lock:
        procs = [p for p in _running if p.poll() is None]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    return len(procs)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the child's process group, SIGKILL if it is still there 2 s later."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=2)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
