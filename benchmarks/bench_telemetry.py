"""Telemetry overhead: CPU time of the sampler thread, as % of one core (budget: 1%), and the
step time of a DDP training loop with telemetry, log() and the live panel on against off
(budget: 2%).

Measured with ``time.thread_time()`` inside the sampler thread (only that thread's CPU time),
first in this process for each rate, then on the workers of a real 2-rank cluster at the
default rate, where the sampler reads the rank's device (NVML, amdsmi, torch.cuda or the host
through psutil, whichever the worker has) and its process::

    .venv/bin/python benchmarks/bench_telemetry.py                 # 10 s per row
    .venv/bin/python benchmarks/bench_telemetry.py --seconds 30 --hz 2,10 --no-cluster
    .venv/bin/python benchmarks/bench_telemetry.py --steps 400 --repeats 5   # the step times
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from monarch_nb import telemetry


def probe_name(monitor: telemetry.Monitor) -> str:
    device = type(monitor.device).__name__ if monitor.device is not None else None
    return f"{monitor.kind}: {device} + psutil" if device else f"{monitor.kind}: psutil"


def in_process(hz: float, seconds: float) -> dict:
    monitor = telemetry.Monitor(telemetry.detect_device())
    sampler = telemetry.Sampler(lambda: monitor.read(0), lambda sample: None, hz).start()
    time.sleep(seconds)
    sampler.stop()
    monitor.close()
    return {
        "where": "this process",
        "probe": probe_name(monitor),
        "hz": hz,
        "seconds": seconds,
        "samples": sampler.samples,
        "cpu_s": sampler.cpu_seconds,
    }


def _sampler_state(engine):
    from monarch_nb import metrics

    rec = engine.worker.extensions[metrics.EXTENSION]
    monitor = rec._monitor
    probe = probe_name(monitor) if monitor is not None else "-"
    return time.monotonic(), rec.sampler.cpu_seconds, rec.sampler.samples, rec.hz, probe


def on_workers(seconds: float) -> list[dict]:
    import monarch_nb
    from monarch_nb import metrics

    ctl = monarch_nb.up(workers=2, cpu=True)
    try:
        if not isinstance(getattr(ctl, "metrics", None), metrics.MetricsHub):
            metrics.install(ctl.client)
        time.sleep(1.5)  # past the sampler's first reading (which builds its probes)
        before = ctl.call(_sampler_state)
        time.sleep(seconds)
        after = ctl.call(_sampler_state)
    finally:
        ctl.down()
    rows = []
    for rank, (t1, cpu1, n1, hz, probe) in after.items():
        t0, cpu0, n0, _, _ = before.item(rank)
        rows.append(
            {
                "where": f"worker, rank {rank}",
                "probe": probe,
                "hz": hz,
                "seconds": t1 - t0,
                "samples": n1 - n0,
                "cpu_s": cpu1 - cpu0,
            }
        )
    return rows


TRAIN = """
import time, torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_nb import log
torch.manual_seed(0)
_model = DDP(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)))
_opt = torch.optim.SGD(_model.parameters(), lr=1e-3)
_x = torch.randn(64, 256)
def _train(steps, logging):
    start = time.perf_counter()
    for step in range(steps):
        loss = _model(_x).pow(2).mean()
        _opt.zero_grad()
        loss.backward()
        _opt.step()
        value = loss.item()  # both modes read the loss, as a training loop that prints it does
        if logging:
            log(step=step, loss=value)
    return 1000 * (time.perf_counter() - start) / steps
"""


def training_overhead(steps: int, repeats: int) -> list[tuple[str, float]]:
    """Median ms per step (mean over the ranks), telemetry + log() + live panel off and on."""
    import monarch_nb
    from monarch_nb import metrics
    from monarch_nb.widgets import LivePanel

    ctl = monarch_nb.up(workers=2, cpu=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        ctl.run(TRAIN)
        ctl.run(f"_train({steps // 4}, False)")  # warm up
        for _ in range(repeats):  # alternate so drift hits both alike
            for mode in ("off", "on"):
                metrics.install(ctl.client, hz=0 if mode == "off" else 2)
                panel = LivePanel(ctl) if mode == "on" else None
                handle = ctl.run(f"_train({steps}, {mode == 'on'})", block=False)
                if panel is not None:
                    panel.track(handle._req)
                    panel.start()
                values = handle.result(timeout=600).values()
                if panel is not None:
                    panel.close()
                times[mode].append(statistics.mean(values))
    finally:
        ctl.down()
    return [(mode, statistics.median(v)) for mode, v in times.items()]


def table(rows: list[dict]) -> str:
    head = ["where", "probe", "Hz", "wall s", "samples", "CPU ms", "% of a core", "us/sample"]
    out = [head]
    for r in rows:
        out.append(
            [
                r["where"],
                r["probe"],
                f"{r['hz']:g}",
                f"{r['seconds']:.1f}",
                str(r["samples"]),
                f"{r['cpu_s'] * 1e3:.1f}",
                f"{100 * r['cpu_s'] / r['seconds']:.3f}",
                f"{1e6 * r['cpu_s'] / max(r['samples'], 1):.0f}",
            ]
        )
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per row")
    parser.add_argument("--hz", default="2,10", help="rates for the in-process rows")
    parser.add_argument("--no-cluster", action="store_true", help="skip the worker rows")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each mode")
    parser.add_argument("--no-training", action="store_true", help="skip the step times")
    args = parser.parse_args()
    rows = [in_process(float(hz), args.seconds) for hz in args.hz.split(",")]
    if not args.no_cluster:
        rows += on_workers(args.seconds)
    print(
        f"sampler-thread CPU time; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(table(rows))
    if not args.no_training:
        (_, off), (_, on) = training_overhead(args.steps, args.repeats)
        print()
        print(
            f"DDP training step, 2 CPU ranks, gloo, median of {args.repeats} runs of {args.steps}"
        )
        print(f"{'telemetry, log() and live panel':<34} {'ms/step':>8}")
        print(f"{'off (sampler at 0 Hz, no log)':<34} {off:>8.3f}")
        print(f"{'on (2 Hz, log every step, panel)':<34} {on:>8.3f}")
        overhead = 100 * (on - off) / off
        print(f"overhead {overhead:+.1f}% (target <= 2%: {'met' if overhead <= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
