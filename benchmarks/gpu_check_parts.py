"""The parts of benchmarks/gpu_check.py: each runs its subprocess within its limit and reads
what it wrote into a Result (passed, one line of headline numbers, and what a --cpu dry-run
left out)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = "tests/kernels/test_monarch_gpu.py"
# The dry-run's stand-in: the custom op and its autograd through the kernels, both paths,
# under the Triton interpreter (test_monarch_gpu.py skips itself without a GPU)
INTERPRETER_TEST = (
    "tests/kernels/test_monarch_triton.py::"
    "test_custom_op_and_autograd_through_kernels_under_interpreter"
)
PER_TEST = {"gpu": 100, "cpu": 60}  # s, pytest-timeout's limit for one test
XDIST_WORKERS = 8  # the GPU machine has 16 cores; Triton compiles on them in parallel
BENCH = {
    "gpu": ["--cases", "4096:64:16384,4096:4:16384", "--dtypes", "bfloat16"],
    # inductor takes ~20 s on 2 cores for the compile(bmm) row: left to the GPU run
    "cpu": [
        *("--device", "cpu", "--cases", "256:4:64", "--dtypes", "float32", "--no-compile"),
        *("--min-time", "0.01", "--calls", "2"),
    ],
}
# The rows part 2 needs, each without an error
BENCH_METHODS = {
    "gpu": [
        *("dense nn.Linear", "bmm pipeline", "fused op", "fused op, CUDA graph", "compile(bmm)"),
        *("op, three_kernel path", "op, blas path"),
    ],
    "cpu": ["dense nn.Linear", "bmm pipeline", "fused op"],
}
PROBE_CASE = "4096:64:16384"
# Everything the default parts write, besides summary.txt and summary.json: 8 files in all
OUR_FILES = (
    "setup.log",
    "kernels-tests.log",
    "bench.txt",
    "bench.json",
    "controller.log",
    "notebook-04.ipynb",
    "probe.log",
    "tune.log",
    "summary.txt",
    "summary.json",
)


@dataclass
class Context:
    out: Path
    cpu: bool
    tmp: Path
    env: dict[str, str]
    info: dict = field(default_factory=dict)  # python, torch, triton, gpu, missing modules

    @property
    def mode(self) -> str:
        return "cpu" if self.cpu else "gpu"


@dataclass
class Result:
    passed: bool
    headline: str
    not_here: str = ""  # what a --cpu dry-run leaves out or replaces
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)


@dataclass
class Step:
    rc: int | None
    seconds: float
    timed_out: bool

    def failure(self, log: Path) -> str:
        """Why the step failed, in words, with the last line of its log."""
        why = f"timed out after {self.seconds:.0f} s" if self.timed_out else f"exit {self.rc}"
        return f"{why}; last line: {_last_line(log)}"


def run_step(cmd: list, log: Path, limit: float, env: dict[str, str]) -> Step:
    """``cmd`` from the repository's root, its output appended to ``log``, stopped (with
    everything it started) after ``limit`` seconds."""
    cmd = [str(c) for c in cmd]
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            rc, timed_out = proc.wait(), True
        seconds = time.monotonic() - started
        f.write(f"[{'timed out' if timed_out else f'exit {rc}'} after {seconds:.1f} s]\n")
    return Step(rc, seconds, timed_out)


def _kill_tree(pid: int) -> None:
    import psutil

    with contextlib.suppress(psutil.Error):
        procs = psutil.Process(pid).children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("[exit", "[timed out"))]
    return lines[-1].strip()[:300] if lines else "(nothing)"


# -- part 1 ---------------------------------------------------------------------------------
def kernels_tests(ctx: Context, limit: float) -> Result:
    log, junit = ctx.out / "kernels-tests.log", ctx.tmp / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfE"]
    cmd += ["--durations=10", f"--timeout={PER_TEST[ctx.mode]}", f"--junitxml={junit}"]
    cmd += [GPU_TESTS, INTERPRETER_TEST] if ctx.cpu else [GPU_TESTS]
    if not ctx.cpu and ctx.info.get("xdist"):
        cmd += ["-n", str(XDIST_WORKERS)]
    step = run_step(cmd, log, limit, ctx.env)
    counts = _junit_counts(junit) if junit.exists() else _log_counts(log)
    text = ", ".join(f"{n} {what}" for what, n in counts.items())
    # on the GPU nothing may skip: a skip there means torch or Triton did not see the GPU
    allowed_skips = 1 if ctx.cpu else 0  # the dry-run: test_monarch_gpu.py skips itself
    passed = (
        step.rc == 0
        and counts["passed"] > 0
        and counts["failed"] + counts["errors"] == 0
        and counts["skipped"] <= allowed_skips
    )
    headline = text if step.rc == 0 or counts["failed"] else f"{text}; {step.failure(log)}"
    not_here = (
        f"{GPU_TESTS} skipped itself (no GPU); in its place the custom op and autograd through "
        "both paths' kernels under the Triton interpreter"
        if ctx.cpu
        else ""
    )
    return Result(passed, headline, not_here, numbers=dict(counts))


def _junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed, errors = total["failures"], total["errors"]
    return {
        "passed": total["tests"] - failed - errors - skipped,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
    }


# a test's line in -v output, as pytest writes it with and without xdist
_TEST_LINE = re.compile(
    r"^(?:\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) "
    r"|\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED))",
    re.M,
)


def _log_counts(log: Path) -> dict[str, int]:
    """What the tests that finished did, read from the log of a run stopped before its end."""
    found = [a or b for a, b in _TEST_LINE.findall(log.read_text(errors="replace"))]
    return {
        "passed": found.count("PASSED"),
        "failed": found.count("FAILED"),
        "errors": found.count("ERROR"),
        "skipped": found.count("SKIPPED"),
    }


# -- part 2 ---------------------------------------------------------------------------------
def kernel_bench(ctx: Context, limit: float) -> Result:
    txt, js = ctx.out / "bench.txt", ctx.out / "bench.json"
    cmd = [sys.executable, "-m", "monarch_kernels.bench", *BENCH[ctx.mode], "--json", js]
    step = run_step(cmd, txt, limit, ctx.env)
    if not js.exists():
        return Result(False, f"no bench.json: {step.failure(txt)}")
    report = json.loads(js.read_text())
    rows, problems = report["rows"], []
    cases = sorted({(r["n"], r["blocks"], r["batch"]) for r in rows}, key=lambda c: -c[1])
    wanted = len(BENCH[ctx.mode][BENCH[ctx.mode].index("--cases") + 1].split(","))
    if not report["complete"]:
        problems.append(f"stopped after {len(cases)} of {wanted} cases: {step.failure(txt)}")
    for case in cases:
        have = {r["method"]: r for r in rows if (r["n"], r["blocks"], r["batch"]) == case}
        for method in BENCH_METHODS[ctx.mode]:
            if method not in have:
                problems.append(f"{case[1]} blocks: no {method} row")
            elif "error" in have[method]:
                problems.append(f"{case[1]} blocks, {method}: {have[method]['error']}")
    headline = "; ".join(_bench_case(rows, case) for case in cases)
    if problems or step.rc != 0:
        headline = "; ".join(problems or [step.failure(txt)]) + f" | {headline}"
    not_here = (
        "CPU float32 at width 256, the torch path; no CUDA-graph, forced-path or "
        "compile(bmm) rows (CUDA, and inductor's ~20 s on 2 cores)"
        if ctx.cpu
        else ""
    )
    numbers = {"rows": len(rows)}
    return Result(step.rc == 0 and not problems, headline, not_here, numbers=numbers)


def _bench_case(rows: list[dict], case: tuple) -> str:
    """One case's numbers: the op eager and graphed, and compile(bmm), each against dense."""
    have = {r["method"]: r for r in rows if (r["n"], r["blocks"], r["batch"]) == case}

    def ms(method: str, key: str) -> str:
        r = have.get(method) or {}
        if r.get(f"{key} ms") is None:
            return ""
        return f"{r[f'{key} ms']:.3f} ms ({r[f'{key} vs dense']:.2f}x dense)"

    pieces = []
    for key in ("fwd", "f+b"):
        timed = [ms("fused op", key), ms("fused op, CUDA graph", key)]
        pieces.append(f"{key} " + ", graph ".join(t for t in timed if t))
    if ms("compile(bmm)", "fwd"):
        pieces.append(f"compile(bmm) fwd {ms('compile(bmm)', 'fwd')}")
    return f"{case[0]}:{case[1]}:{case[2]} " + ", ".join(pieces)


# -- parts 3a and 3b: benchmarks/gpu_check_controller.py in a process of its own ------------
def controller(ctx: Context, limit: float) -> Result:
    return _controller_part(ctx, limit, "controller")


def notebook(ctx: Context, limit: float) -> Result:
    return _controller_part(ctx, limit, "notebook")


def _controller_part(ctx: Context, limit: float, what: str) -> Result:
    missing = ctx.info.get("missing") or []
    if missing:
        return Result(
            False,
            f"not run: {', '.join(missing)} missing; carry the wheels "
            "(--download-wheels DIR here, --wheels DIR there)",
        )
    log, result = ctx.out / "controller.log", ctx.tmp / f"{what}.json"
    script = ROOT / "benchmarks" / "gpu_check_controller.py"
    cmd = [sys.executable, script, what, "--result", result, "--out", ctx.out]
    # its cells' own waits must end before the part's limit does
    cmd += ["--limit", f"{limit - 10:.0f}"] + (["--cpu"] if ctx.cpu else [])
    step = run_step(cmd, log, limit, ctx.env)
    if not result.exists():
        return Result(False, step.failure(log))
    r = json.loads(result.read_text())
    headline = r["headline"]
    if r["problems"]:
        headline = "; ".join(r["problems"]) + f" | {headline}"
    passed = step.rc == 0 and not r["problems"]
    return Result(passed, headline, r.get("not_here", ""), numbers=r.get("numbers", {}))


# -- opt-in: gpu_kernels.sh's other two steps, for work on the kernels -----------------------
def stage_probe(ctx: Context, limit: float) -> Result:
    log = ctx.out / "probe.log"
    cmd = [sys.executable, ROOT / "benchmarks" / "gpu_stage_probe.py", "--case", PROBE_CASE]
    step = run_step(cmd, log, limit, ctx.env)
    ok = step.rc == 0
    return Result(ok, f"{PROBE_CASE} in probe.log" if ok else step.failure(log))


def tune(ctx: Context, limit: float) -> Result:
    log = ctx.out / "tune.log"
    step = run_step(
        [sys.executable, "-m", "monarch_kernels.tune", "--case", PROBE_CASE], log, limit, ctx.env
    )
    ok = step.rc == 0
    return Result(ok, f"{PROBE_CASE} in tune.log" if ok else step.failure(log))
