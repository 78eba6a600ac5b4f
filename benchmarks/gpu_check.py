"""The whole product checked on a GPU machine in one call, written before one is at hand.

A GPU machine is lent now and then, for about 15 minutes in all, so this is the one command to
run on it. Each part runs as a subprocess with its own time limit (one that hangs cannot eat
the others' time) inside a budget of 480 s; everything goes to one folder, and the script ends
with one line per part, passed or failed, with its headline numbers:

    part 1  kernels tests  tests/kernels/test_monarch_gpu.py (every path and config against the
                           float64 reference, gradients, the eager route, CUDA-graph replay,
                           torch.compile), each test with its own time limit
    part 2  kernel bench   python -m monarch_kernels.bench at width 4096, 64 and 4 blocks, bf16,
                           batch 16384, eager and CUDA graph, against dense nn.Linear and
                           torch.compile of the two-bmm pipeline: bench.json and bench.txt
    part 3a controller     %monarch up in a real IPython shell (one worker pinned to the GPU), a
                           cell training MonarchLinear for 20 s, NVML's utilization and memory
                           against torch's, %monarch down leaving no process
    part 3b notebook 04    notebooks/04-distributed-training.ipynb run by a Jupyter kernel

The GPU machine cannot reach a package registry and its python3 has torch, Triton and pytest
but not Dask, IPython or Jupyter: those travel as wheels, downloaded here once (for its Python
3.12, the versions this project's environment has), and are installed there into a folder of
their own. Here, in the repository's root:

    .venv/bin/python benchmarks/gpu_check.py --download-wheels .gpu-wheels

then the device tool's ``run`` with ``carry=[".gpu-wheels"]``, ``timeout_s=540`` and the command

    python3 benchmarks/gpu_check.py --wheels .gpu-wheels --out "$OUT"

The dry-run here, which tests/test_gpu_check.py runs (the Triton interpreter, a CPU worker,
psutil in place of NVML, small sizes; what it leaves out is named in its lines):

    python benchmarks/gpu_check.py --cpu --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gpu_check_parts as parts
import gpu_check_wheels
import orphans
from gpu_check_parts import Result

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 480.0  # s, the whole check; the device tool's run gets 540 (timeout_s) around it
FLOOR = 20.0  # s: a part that would get less than this is not started
SETUP_LIMIT = 120.0
# The device tool brings back at most 8 files from $OUT: the default parts write exactly 8.
MAX_FILES = 8
# What parts 3a and 3b import that the GPU machine's python3 may lack (the wheels bring them)
CONTROLLER_MODULES = ("IPython", "distributed", "ipykernel", "jupyter_client", "nbclient", "bokeh")


@dataclass
class Part:
    key: str
    name: str
    limit: float  # s on a GPU that the parts after this one keep for themselves
    cpu_limit: float  # the same in the dry-run
    run: Callable[[parts.Context, float], Result]
    default: bool = True


PARTS = [
    # the limits sum to 460 s of the 480: pip's install and the probe of the machine take ~10
    Part("1", "kernels tests", 110, 60, parts.kernels_tests),
    Part("2", "kernel bench", 150, 60, parts.kernel_bench),
    Part("3a", "controller", 100, 60, parts.controller),
    Part("3b", "notebook 04", 100, 90, parts.notebook),
    # gpu_kernels.sh's two other steps, for kernel work; not in the default run's budget
    Part("probe", "stage probe", 150, 60, parts.stage_probe, default=False),
    Part("tune", "config timings", 150, 60, parts.tune, default=False),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-check", help="the folder")
    p.add_argument("--cpu", action="store_true", help="the dry-run: no GPU, small sizes")
    p.add_argument("--wheels", metavar="DIR", help="install these wheels first (on the GPU)")
    p.add_argument("--download-wheels", metavar="DIR", help="here: fetch what --wheels installs")
    p.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole check")
    keys = [part.key for part in PARTS]
    p.add_argument(
        "--parts",
        default=",".join(part.key for part in PARTS if part.default),
        help=f"comma-separated, in the order given, from {', '.join(keys)}",
    )
    args = p.parse_args(argv)
    if args.download_wheels:
        return gpu_check_wheels.download(Path(args.download_wheels))
    chosen = [k.strip() for k in args.parts.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in keys]
    if unknown or not chosen:
        p.error(f"--parts: unknown {', '.join(unknown) or 'nothing'}; choose from {keys}")
    if args.budget < FLOOR:
        p.error(f"--budget must be at least {FLOOR:.0f} s")
    start = time.monotonic()
    deadline = start + args.budget
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in parts.OUR_FILES:  # logs are appended to: a rerun into the folder starts afresh
        (out / name).unlink(missing_ok=True)
    orphans.become_subreaper()  # what a part leaves running comes back to us, to be swept up
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = parts.Context(out=out, cpu=args.cpu, tmp=Path(tmp), env=_base_env(args.cpu))
        setup_error = _setup(ctx, args.wheels, SETUP_LIMIT)
        if setup_error:
            print(f"gpu_check: {setup_error}", file=sys.stderr)
            return 2
        results = _run_parts(ctx, [next(p for p in PARTS if p.key == k) for k in chosen], deadline)
    return _summarize(ctx, results, time.monotonic() - start)


def _base_env(cpu: bool) -> dict[str, str]:
    path = [str(ROOT), str(ROOT / "kernels")]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
    env["MPLBACKEND"] = "Agg"
    if cpu:
        env["TRITON_INTERPRET"] = "1"  # kernels launched on CPU tensors run in the interpreter
    return env


def _setup(ctx: parts.Context, wheels: str | None, limit: float) -> str | None:
    """The wheels installed into a folder of their own, then what the machine is; an error
    line where nothing can be checked."""
    log = ctx.out / "setup.log"
    if wheels:
        found = sorted(Path(wheels).glob("*.whl"))
        if not found:
            return (
                f"no wheels in {wheels}: run `python benchmarks/gpu_check.py --download-wheels "
                f"{wheels}` on a machine that reaches PyPI, and carry that folder"
            )
        site = ctx.tmp / "site"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *found]
        step = parts.run_step(cmd, log, limit, ctx.env)
        if step.rc != 0:
            return f"installing the {len(found)} wheels failed (exit {step.rc}): see {log}"
        ctx.env["PYTHONPATH"] = os.pathsep.join([str(site), ctx.env["PYTHONPATH"]])
    info_file = ctx.tmp / "env.json"
    parts.run_step(
        [sys.executable, "-c", _ENV_PROBE, str(info_file), *CONTROLLER_MODULES], log, 120, ctx.env
    )
    ctx.info = json.loads(info_file.read_text()) if info_file.exists() else {}
    ctx.info["commit"] = _commit()
    if not ctx.cpu and not ctx.info.get("cuda"):
        return (
            f"torch sees no GPU here ({ctx.info.get('torch', 'torch not importable')}); "
            f"on a machine without one, --cpu runs the dry-run (see {log})"
        )
    if not ctx.cpu:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem"]
        parts.run_step([*smi, "--format=csv"], log, 30, ctx.env)
    return None


# Run in the children's environment: what the machine is, and which modules are missing.
_ENV_PROBE = """
import importlib.util, json, platform, sys
info = {"python": platform.python_version()}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = torch.cuda.is_available()
    info["gpu"] = torch.cuda.get_device_name(0) if info["cuda"] else None
except Exception as e:
    info["torch"] = f"torch not importable: {e}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception:
    info["triton"] = None
info["missing"] = [m for m in sys.argv[2:] if importlib.util.find_spec(m) is None]
info["xdist"] = importlib.util.find_spec("xdist") is not None
json.dump(info, open(sys.argv[1], "w"))
"""


def _commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    return proc.stdout.strip() if proc.returncode == 0 else "unknown (not a git checkout)"


def _run_parts(ctx: parts.Context, chosen: list[Part], deadline: float) -> list[tuple]:
    """Each part in turn. A part may run for what is left of the budget less the limits of the
    parts after it: time an early part does not use goes to the later ones, and one that hangs
    takes no more than its own limit and the slack in the budget."""
    results = []
    own = [part.cpu_limit if ctx.cpu else part.limit for part in chosen]
    for i, part in enumerate(chosen):
        left = deadline - time.monotonic()
        limit = left - sum(own[i + 1 :])
        if limit < FLOOR:
            result = Result(False, f"not run: {left:.0f} s of the budget left")
        else:
            print(f"gpu_check: part {part.key} {part.name} (at most {limit:.0f} s)", flush=True)
            started = time.monotonic()
            try:
                result = part.run(ctx, limit)
            except Exception as e:  # a bug in the part's own reading: the other parts still run
                result = Result(False, f"the check itself failed: {type(e).__name__}: {e}")
            result.seconds = time.monotonic() - started
        left_behind = orphans.sweep()
        if left_behind:
            result.passed = False
            result.headline += f"; {left_behind} process(es) left running, killed"
        results.append((part, result))
        print(_line(part, result), flush=True)
    return results


def _line(part: Part, r: Result) -> str:
    verdict = "passed" if r.passed else "failed"
    line = f"part {part.key} {part.name}: {verdict} in {r.seconds:.0f} s; {r.headline}"
    return line + (f" (cpu dry-run: {r.not_here})" if r.not_here else "")


def _summarize(ctx: parts.Context, results: list[tuple], seconds: float) -> int:
    info = ctx.info
    where = info.get("gpu") or "CPU (dry-run)"
    header = (
        f"gpu check on {where}: python {info.get('python')}, torch {info.get('torch')}, "
        f"triton {info.get('triton')}, commit {info.get('commit')}"
    )
    lines = [_line(part, r) for part, r in results]
    passed = sum(r.passed for _, r in results)
    files = sorted(p.name for p in ctx.out.iterdir() if p.is_file())
    lines.append(f"{passed} of {len(results)} parts passed in {seconds:.0f} s; files in {ctx.out}")
    if len(files) + 2 > MAX_FILES:  # with summary.txt and summary.json, written below
        lines.append(f"{len(files) + 2} files: the device tool brings back {MAX_FILES} at most")
    summary = {
        "mode": "cpu" if ctx.cpu else "gpu",
        "env": info,
        "seconds": seconds,
        "parts": [{"key": p.key, "name": p.name, **asdict(r)} for p, r in results],
        "lines": lines,
    }
    (ctx.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (ctx.out / "summary.txt").write_text("\n".join([header, *lines]) + "\n")
    print("\n" + "\n".join([header, *lines]), flush=True)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
