"""One measurement in a fresh process: a benchmark's driver runs its own script again with
``--one WHAT N`` (``run``), which measures and prints its result as one JSON line after MARK
(``answer``); processes a measurement left behind are swept up after each."""

from __future__ import annotations

import json
import subprocess
import sys

import orphans as leftovers

MARK = "BENCH_RESULT "


def run(script: str, argv: list[str], timeout: float) -> dict:
    """``script`` with ``argv`` (``--one WHAT N`` and its options) in a fresh process: its result,
    with ``orphans`` (what was swept up), or ``{"error": ...}`` rather than an exception."""
    try:
        proc = subprocess.run(
            [sys.executable, script, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
        if lines:
            result = json.loads(lines[-1][len(MARK) :])
        else:
            tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            result = {"error": tail[:160]}
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {timeout:.0f} s"}
    except BaseException:
        leftovers.sweep()
        raise
    result["orphans"] = leftovers.sweep()
    return result


def answer(measure) -> None:
    """In the fresh process: print what ``measure()`` returns, or the one line of its error
    (the driver prints it as "not available: ...")."""
    try:
        result = measure()
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    print(MARK + json.dumps(result), flush=True)
