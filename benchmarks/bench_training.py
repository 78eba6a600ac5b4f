"""The same DDP training script launched three ways, steps per second side by side.

    python benchmarks/bench_training.py [--steps 300] [--repeats 3] [--model monarch|dense]

1. ``torchrun --nproc-per-node 2 train_digits.py`` (monarch_nb/examples/, the script notebook 04
   runs)
2. ``%monarch run train_digits.py`` (``controller.launch.run_script``) on a 2-rank cluster
3. a ``%%monarch`` cell that calls the script's ``main()`` inside the cluster's process group

Steps per second are measured inside the script (after a warm-up), so start-up is not counted.
Target: the single controller adds at most 3% over torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import machine

# by its path, the same file each way: the launchers are what is measured
SCRIPT = Path(importlib.util.find_spec("monarch_nb.examples.train_digits").origin)


def torchrun(args: list[str]) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return _steps(out)


def _steps(text: str) -> float:
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0 and '"steps_per_s"' in line:
            return json.loads(line[start:])["steps_per_s"]
    raise RuntimeError(f"no result line in output:\n{text[-2000:]}")


def monarch_run(ctl, args: list[str]) -> float:
    from monarch_nb.controller.launch import run_script

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_script(ctl, str(SCRIPT), args)
    return _steps(buf.getvalue())


def monarch_cell(ctl, args: list[str]) -> float:
    code = (
        f"import runpy\n_ns = runpy.run_path({str(SCRIPT)!r})\n_ns['main']({args!r})['steps_per_s']"
    )
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        return ctl.run(code).item(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=["monarch", "dense"], default="monarch")
    opts = p.parse_args()
    args = ["--model", opts.model, "--steps", str(opts.steps)]

    import monarch_nb

    results: dict[str, list[float]] = {"torchrun": [], "%monarch run": [], "%%monarch cell": []}
    ctl = monarch_nb.up(workers=2, cpu=True)
    try:
        for _ in range(opts.repeats):  # interleaved so drift hits every launcher alike
            results["torchrun"].append(torchrun(args))
            results["%monarch run"].append(monarch_run(ctl, args))
            results["%%monarch cell"].append(monarch_cell(ctl, args))
    finally:
        ctl.down()

    print(f"# {machine.cpu()}; {machine.versions(('torch', 'monarch-nb'))}; gloo, 2 ranks")
    print(f"# model={opts.model}, {opts.steps} timed steps, median of {opts.repeats}")
    base = statistics.median(results["torchrun"])
    print(f"{'launcher':<16} {'steps/s':>9} {'vs torchrun':>12} {'overhead':>9}  {'range':>13}")
    for name, values in results.items():
        med = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(
            f"{name:<16} {med:>9.1f} {med / base:>11.3f}x {100 * (base - med) / base:>8.1f}%"
            f"  {spread:>13}"
        )
    worst = max(100 * (base - statistics.median(v)) / base for v in results.values())
    print(f"# target: overhead <= 3%: {'met' if worst <= 3 else 'NOT met'} (worst {worst:.1f}%)")


if __name__ == "__main__":
    main()
