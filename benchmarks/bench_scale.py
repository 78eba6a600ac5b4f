"""``%monarch scale``: growing a local cluster from 2 to 4 CPU ranks against starting one of 2.

Each repetition, in this one process: ``monarch_nb.up(workers=2, cpu=True)`` until a cell's
gloo ``all_reduce`` has run on both ranks ("up 2"); then ``ctl.scale(4)`` until the same cell
has run on all 4 with the process group formed again ("scale 2 -> 4"); then ``ctl.scale(2)``
the same way ("scale 4 -> 2", no target); then down. The two are timed in the same run, one
after the other, so that the machine's load falls on both alike. The issue's target: growing
takes at most 1.2x the time ``up`` takes. Warm-up repetitions (untimed) come first: the first
cluster of a process pays imports that later ones do not.

    python benchmarks/bench_scale.py               # 5 repetitions after 1 warm-up
    python benchmarks/bench_scale.py --reps 2 --warmup 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import machine

TARGET = 1.2  # scale 2 -> 4 / up 2, medians
CELL = (
    "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())"
)


def timed_cell(ctl, n: int) -> None:
    values = ctl.run(CELL, quiet=True).values()
    if values != [n] * n:
        raise RuntimeError(f"all_reduce over {n} ranks gave {values}")


def one(monarch_nb) -> dict[str, float]:
    t0 = time.perf_counter()
    ctl = monarch_nb.up(workers=2, cpu=True)
    try:
        timed_cell(ctl, 2)
        up = time.perf_counter() - t0
        t0 = time.perf_counter()
        ctl.scale(4)
        timed_cell(ctl, 4)
        grow = time.perf_counter() - t0
        t0 = time.perf_counter()
        ctl.scale(2)
        timed_cell(ctl, 2)
        shrink = time.perf_counter() - t0
    finally:
        ctl.down()
    return {"up": up, "grow": grow, "shrink": shrink}


def main(args) -> None:
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    import monarch_nb

    for _ in range(args.warmup):
        one(monarch_nb)
    runs = [one(monarch_nb) for _ in range(args.reps)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = med["grow"] / med["up"]
    lines = [
        "monarch-nb %monarch scale benchmark",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(('torch', 'monarch-nb', 'dask', 'distributed'))}",
        f"load average (1 min) before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}",
        f"CPU ranks (gloo); each time ends when a cell's all_reduce has run on every rank; "
        f"{args.reps} repetitions after {args.warmup} warm-up, in one process; times in s",
        "",
        f"{'what':<16}{'median':>8}{'min':>8}{'max':>8}{'/ up 2':>8}",
    ]
    for key, name in (("up", "up 2"), ("grow", "scale 2 -> 4"), ("shrink", "scale 4 -> 2")):
        xs = [r[key] for r in runs]
        lines.append(
            f"{name:<16}{med[key]:>8.2f}{min(xs):>8.2f}{max(xs):>8.2f}{med[key] / med['up']:>7.2f}x"
        )
    met = "met" if ratio <= TARGET else "NOT met"
    lines += [
        "",
        f"scale 2 -> 4 / up 2: {ratio:.2f}x (target <= {TARGET}x: {met})",
        f"total wall time: {time.perf_counter() - began:.0f} s",
    ]
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
