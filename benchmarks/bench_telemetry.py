"""Telemetry overhead: CPU time of the sampler thread, as % of one core (budget: 1%).

Measured with ``time.thread_time()`` inside the sampler thread (only that thread's CPU time),
first in this process for each rate, then on the workers of a real 2-rank cluster at the
default rate, where the sampler reads the rank's device (NVML, amdsmi, torch.cuda or the host
through psutil, whichever the worker has) and its process::

    .venv/bin/python benchmarks/bench_telemetry.py                 # 10 s per row
    .venv/bin/python benchmarks/bench_telemetry.py --seconds 30 --hz 2,10 --no-cluster
"""

from __future__ import annotations

import argparse
import os
import platform
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
    args = parser.parse_args()
    rows = [in_process(float(hz), args.seconds) for hz in args.hz.split(",")]
    if not args.no_cluster:
        rows += on_workers(args.seconds)
    print(
        f"sampler-thread CPU time; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
