"""How fast one rank's failure releases the others (dispatch/releasing.py), at 2, 4 and 16 ranks.

The last rank raises half a second into a cell while the others wait for it in an
``all_reduce`` (holding the group in a DistributedDataParallel model, so that only cutting the
group's connections frees them) or run Python code. Each rank writes the time: the failing one
as it raises, the others as their wait ends (a ``finally``). Release is the latest of the
others' ends after the failure, on one host's clock; the cell's return is what the notebook
waits, forming the group again included. The baseline is the same cell without the release:
the others wait for the group's timeout (5 s here; 30 s is the default), and the next cell's
collective then fails.

    python benchmarks/bench_release.py [--ranks 2 4 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import monarch_nb
from monarch_nb import CellError
from monarch_nb.controller.dist import form_group

SETUP = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(torch.nn.Linear(2, 2))
"""
FAIL = """
if rank == world_size - 1:
    time.sleep(0.5)  # the others are waiting by then
    failed_at = time.time()
    raise RuntimeError("out of data")
try:
    {wait}
finally:
    freed_at = time.time()
"""
WAITS = {
    "all_reduce": "dist.all_reduce(torch.ones(1))",
    "Python code": "end = time.time() + 60\n    while time.time() < end: pass",
}


def once(ctl, wait: str) -> tuple[float, float]:
    """(release s, the cell's return after the failure s)."""
    start = time.monotonic()
    with contextlib.suppress(CellError):
        ctl.run(FAIL.format(wait=WAITS[wait]), quiet=True)
    returned = time.monotonic() - start - 0.5
    last = ctl.world_size - 1
    failed_at = ctl.pull("failed_at", targets=last).item()
    freed = ctl.pull("freed_at", targets=list(range(last))).values()
    return max(freed) - failed_at, returned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 16])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, gloo, CPU ranks on one host")
    print(f"# median of {args.repeats}; release: the failure to the last other rank's end")
    print("| ranks | the others wait in | release ms | cell returned after the failure ms |")
    print("|---|---|---|---|")
    for n in args.ranks:
        ctl = monarch_nb.up(workers=n, cpu=True, current=False)
        try:
            ctl.run(SETUP)
            for wait in WAITS:
                runs = [once(ctl, wait) for _ in range(args.repeats)]
                release = statistics.median(r[0] for r in runs)
                returned = statistics.median(r[1] for r in runs)
                print(f"| {n} | {wait} | {1e3 * release:.0f} | {1e3 * returned:.0f} |", flush=True)
                ctl.run(SETUP)  # a group formed again needs its DDP model wrapped again
            if n == args.ranks[0]:
                baseline(ctl)
        finally:
            ctl.down()


def baseline(ctl) -> None:
    """The same failure without the release: the group's timeout (5 s) frees the others."""
    form_group(ctl, timeout=5)
    ctl.run(SETUP)
    ctl._release = lambda: None  # this controller only: no release
    release, returned = once(ctl, "all_reduce")
    try:
        ctl.run("dist.all_reduce(torch.ones(1))", quiet=True)
        after = "works"
    except CellError as e:
        after = f"fails: {next(iter(e.errors.values())).evalue[:60]}"
    print(
        f"| {ctl.world_size} | all_reduce, without the release (5 s timeout) | "
        f"{1e3 * release:.0f} | {1e3 * returned:.0f} (the next cell's all_reduce {after}) |"
    )


if __name__ == "__main__":
    main()
