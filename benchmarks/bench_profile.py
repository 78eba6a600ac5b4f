"""What ``%%monarch --profile`` costs, and how well it lines the ranks' clocks up.

    python benchmarks/bench_profile.py [--ranks 2 4] [--steps 40] [--repeats 4]

On a local cluster of N CPU ranks (gloo), one DDP loop of ``--steps`` steps, each step timed on
its rank with ``time.perf_counter``, run unprofiled and under the default profile (steps 1-3
measured after the warm-up step 0), taking turns, ``--repeats`` times each:

- overhead during the profiled steps: the median step time of steps 1-2 profiled over the same
  steps unprofiled (target: at most 1.3x), and of the steps after the recorded ones (target:
  1.0x: the profiler has stopped); the profiler's start (in step 0) and stop (in step 3) apart,
  as a one-off cost in ms;
- trace bytes per rank per profiled step (the rank's ``rank-N.json`` over its 4 recorded steps);
- the picture: from the last rank's reply to the timeline shown (the profile's ``show``: traces
  unpacked and written, clocks measured, analysed; plus the figure built and serialized as the
  widget sends it, which a script skips; target 2 s at 4 ranks);
- clock alignment: the ranks' ends of BARRIERS ``dist.barrier()`` calls in the warm-up step, on
  the aligned timeline: they leave one within a message of each other, so the least spread
  bounds the error (target 1 ms on one host), beside the offsets' own bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import machine

CELL = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
layers = [torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)]
model = DDP(torch.nn.Sequential(*layers))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
times = []
for step in range({steps}):
    t = time.perf_counter()
    if step == 0:  # in the warm-up step: the known events, each left by every rank at once
        for _ in range({BARRIERS}):
            dist.barrier()
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    times.append(time.perf_counter() - t)
times
"""
BARRIERS = 5
MEASURED = range(0, 4)  # the recorded steps of the default profile: warm-up 0, measured 1-3


def run(ctl, steps: int, profile) -> tuple[list[list[float]], float | None]:
    """Each rank's step times, and the seconds the profile took to show (None unprofiled)."""
    from monarch_nb.controller import profiling

    shown: list[float] = []
    original = profiling.Profiled.show

    def timed(self, outcomes):
        t = time.perf_counter()
        original(self, outcomes)
        shown.append(time.perf_counter() - t)

    profiling.Profiled.show = timed
    try:
        values = ctl.run(CELL.format(steps=steps, BARRIERS=BARRIERS), profile=profile).values()
    finally:
        profiling.Profiled.show = original
    return values, shown[0] if shown else None


def barrier_spread_us(directory) -> float:
    """How far apart the ranks leave a barrier on the merged (aligned) trace: the least of the
    BARRIERS, since a rank that shares a core may only run some time after its barrier ended."""
    merged = json.loads((directory / "merged.json").read_text())
    ends: dict[int, list[float]] = {}
    for e in merged["traceEvents"]:
        if e.get("ph") == "X" and e["name"] == "gloo:barrier":
            ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
    per_rank = [sorted(v) for v in ends.values()]
    return min(max(b) - min(b) for b in zip(*per_rank, strict=True))


def picture_s(profile) -> float:
    """The figure built and serialized as the widget sends it to the page: what a script does
    not do (it prints the numbers only), timed here apart and added."""
    from bokeh.embed import json_item

    from monarch_nb.telemetry.timeline_figure import layout

    t = time.perf_counter()
    json.dumps(json_item(layout(profile.analysis, profile.title)))
    return time.perf_counter() - t


def main() -> None:
    import monarch_nb

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    print(f"machine: {machine.cpu()}")
    print(f"software: {machine.versions(('torch', 'bokeh', 'HolisticTraceAnalysis'))}")
    rows = []
    for n in args.ranks:
        ctl = monarch_nb.up(workers=n, cpu=True)
        try:
            folder = tempfile.mkdtemp(prefix="bench-profile-")
            plain, profiled, show, sizes, spread, bound = [], [], [], [], [], []
            for repeat in range(args.repeats):
                if repeat % 2 == 0:  # taking turns at going first
                    plain.append(run(ctl, args.steps, None)[0])
                values, seconds = run(ctl, args.steps, f"dir={folder}")
                if repeat % 2 == 1:
                    plain.append(run(ctl, args.steps, None)[0])
                profiled.append(values)
                show.append(seconds + picture_s(ctl.last_profile))
                d = ctl.last_profile.directory
                sizes += [(d / f"rank-{r}.json").stat().st_size / len(MEASURED) for r in range(n)]
                spread.append(barrier_spread_us(d))
                bound.append(ctl.last_profile.analysis.timeline.align_error_us)

            def med(runs, steps) -> float:
                return statistics.median(t for v in runs for rank in v for t in rank[steps])

            # steps 1-2 are recorded only; 0 starts the profiler and 3 stops it (one-off costs,
            # said apart); the trace is written after the cell
            inside, after = slice(1, 3), slice(MEASURED.stop, None)

            def once(runs) -> float:
                return statistics.median(rank[0] + rank[3] for v in runs for rank in v)

            rows.append(
                {
                    "ranks": n,
                    "step ms (plain)": med(plain, inside) * 1e3,
                    "profiled steps x": med(profiled, inside) / med(plain, inside),
                    "after x": med(profiled, after) / med(plain, after),
                    "start+stop ms": (once(profiled) - once(plain)) * 1e3,
                    "trace KiB/rank/step": statistics.median(sizes) / 1024,
                    "picture s": statistics.median(show),
                    "barrier spread us": statistics.median(spread),
                    "offset bound us": max(bound),
                }
            )
        finally:
            ctl.down()
    cols = list(rows[0])
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for row in rows:
        print(
            " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols)
        )


if __name__ == "__main__":
    main()
