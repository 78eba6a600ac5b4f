"""``%monarch attach`` to a kept cluster against a fresh ``%monarch up``, from a new kernel.

Each repetition starts a new kernel (jupyter_client, as JupyterLab starts one), runs
``%load_ext monarch_nb`` (untimed: as the notebook's first cell), then times, from the client,
two cells sent at once: the command and ``%%monarch rank``, until the second answers. "up" is
``%monarch up --workers N --cpu`` (then ``%monarch down``); "attach" is ``%monarch attach`` to
a kept cluster of N CPU ranks that an earlier kernel started with ``--keep`` (its kernel then
shut down; each repetition's kernel exits in turn, leaving it detached). "up --keep" is timed
once, for the record. The issue's target: attach takes at most 0.3x the time up takes.

    python benchmarks/bench_attach.py                 # 2 and 4 ranks, 3 repetitions each
    python benchmarks/bench_attach.py --ranks 2 --reps 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import machine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TARGET = 0.3  # attach / up, medians


def new_kernel(runtime: Path):
    from _kernel import CellKernel

    kernel = CellKernel(runtime)
    kernel.run("%load_ext monarch_nb")
    return kernel


def timed(kernel, command: str, n: int) -> float:
    """Seconds from sending ``command`` until a ``%%monarch`` cell sent right after it answers
    on every rank."""
    t0 = time.perf_counter()
    first = kernel.start(command)
    second = kernel.start("%%monarch\nrank")
    kernel.messages(first)
    msgs = kernel.messages(second)
    elapsed = time.perf_counter() - t0
    for _ in range(2):
        reply = kernel.kc.get_shell_msg(timeout=60)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{command}: {reply['content']}")
    values = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "execute_result"]
    want = f"ValueMesh({{{', '.join(f'{r}: {r}' for r in range(n))}}})"
    if values != [want]:
        raise RuntimeError(f"{command}: the cell answered {values}, not {want}")
    return elapsed


def one_size(runtime: Path, n: int, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"up": [], "attach": [], "up --keep": []}
    for _ in range(reps):
        kernel = new_kernel(runtime)
        try:
            times["up"].append(timed(kernel, f"%monarch up --workers {n} --cpu", n))
            kernel.run("%monarch down")
        finally:
            kernel.close()
    kernel = new_kernel(runtime)
    name = f"bench-{n}"
    try:
        command = f"%monarch up --keep 10m --name {name} --workers {n} --cpu"
        times["up --keep"].append(timed(kernel, command, n))
    finally:
        kernel.close()
    try:
        for _ in range(reps):
            kernel = new_kernel(runtime)
            try:
                times["attach"].append(timed(kernel, f"%monarch attach {name}", n))
            finally:
                kernel.close()
    finally:
        kernel = new_kernel(runtime)
        kernel.run(f"%monarch attach {name}\n%monarch down")
        kernel.close()
    return times


def main(args) -> None:
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    runtime = Path(tempfile.mkdtemp(prefix="bench-attach-"))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
    results = {n: one_size(runtime, n, args.reps) for n in args.ranks}
    lines = [
        "monarch-nb %monarch attach benchmark",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(('torch', 'monarch-nb', 'dask', 'distributed'))}",
        f"load average (1 min) before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}",
        "a new kernel each time, %load_ext first (untimed); from sending the command until "
        f"%%monarch rank answers; CPU ranks; {args.reps} repetitions; times in s",
        "",
        f"{'what':<12}{'ranks':>6}{'median':>8}{'min':>8}{'max':>8}{'/ up':>8}",
    ]
    verdicts = []
    for n, times in results.items():
        up = statistics.median(times["up"])
        for key in ("up", "up --keep", "attach"):
            xs = times[key]
            med = statistics.median(xs)
            lines.append(
                f"{key:<12}{n:>6}{med:>8.2f}{min(xs):>8.2f}{max(xs):>8.2f}{med / up:>7.2f}x"
            )
        ratio = statistics.median(times["attach"]) / up
        verdicts.append(
            f"attach / up at {n} ranks: {ratio:.2f}x (target <= {TARGET}x: "
            f"{'met' if ratio <= TARGET else 'NOT met'})"
        )
    lines += ["", *verdicts, f"total wall time: {time.perf_counter() - began:.0f} s"]
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
