"""How monarch-nb behaves from 2 to 64 ranks on one machine, with PyTorch Monarch's and
ipyparallel's round trips at the same sizes, and the controller's CPU per added rank fitted.

Every system and size runs in a fresh subprocess (this script re-invoked with ``--one SYSTEM
N``); this process is a child subreaper, so whatever a measurement leaves behind is found and
killed (orphans.py). The ranks are CPU ranks forked from the forkserver, one process each.

    python benchmarks/bench_ranks.py                          # 2, 4, 8, 16, 32, 64 ranks
    python benchmarks/bench_ranks.py --ranks 2 4 8 --only monarch --cells 100
    python benchmarks/bench_ranks.py --one monarch 8          # one raw JSON line

Per size, for monarch-nb: ``up`` until a cell has imported torch (the gloo group formed);
``ctl.run("1")`` round trips (p50, p99); the controller's own CPU per such cell (the
notebook's thread, the Reader's and its writers', ``CpuMeter``), with the request relay's where
one runs (from 16 ranks, dispatch/relaying.py: ``+ relay``), and the whole kernel process's
beyond its idle use (it holds the scheduler and the nannies too); a cell printing 100 lines
on every rank (the time until the last line is shown, and how many lines were shown for the
100 x N printed); ``push`` of 1 MiB to every rank and ``pull`` of 1 MiB from each; 1,000 actor
broadcasts then a call; the kernel's CPU and RSS while idle; Ctrl-C one second into a cell
that keeps every rank busy, until the cell has returned with every rank interrupted; the
telemetry store's bytes after 10 minutes (ranks_measure._store_bytes). For torchmonarch, its
``spawn_procs`` and an actor's ``call()`` (and 1,000 broadcasts); for ipyparallel, ``%%px``'s
``execute(block=True)``: where they start.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time

import fresh_process
import machine
import orphans as leftovers
import ranks_measure

SYSTEMS = {"monarch": "monarch-nb", "torchmonarch": "torchmonarch", "ipyparallel": "ipyparallel"}
PACKAGES = ("torch", "monarch-nb", "dask", "distributed", "torchmonarch", "ipyparallel")
# The targets: the controller's CPU per added rank, and monarch-nb's round trip against
# torchmonarch's call() at the largest size.
PER_RANK_TARGET = 20e-6
PEER_TARGET = 0.5


def run_one(system: str, n: int, args) -> dict:
    argv = ["--one", system, str(n)]
    argv += ["--cells", str(args.cells), "--warmup", str(args.warmup), "--idle", str(args.idle)]
    return fresh_process.run(os.path.abspath(__file__), argv, args.timeout)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b * n``: (a, b)."""
    k = len(points)
    mx = sum(n for n, _ in points) / k
    my = sum(y for _, y in points) / k
    sxx = sum((n - mx) ** 2 for n, _ in points)
    b = sum((n - mx) * (y - my) for n, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def _table(rows: list[list[str]]) -> list[str]:
    full = [r for r in rows if len(r) == len(rows[0])]
    widths = [max(len(r[i]) for r in full) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        if len(row) < len(widths):  # "not available: ...": runs on from its column
            cells = [row[0].ljust(widths[0])]
            cells += [c.rjust(widths[i + 1]) for i, c in enumerate(row[1:-1])]
            out.append("  ".join([*cells, row[-1]]))
            continue
        out.append(
            "  ".join(
                c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)
            )
        )
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def _interrupted(r: dict, n: int) -> str:
    took = f"{r['interrupt_s']:.2f}"
    return took if r["interrupted"] == n else f"{took} ({r['interrupted']} of {n} stopped)"


def _mb(x: float) -> str:
    return f"{x / 2**20:.1f}"


def tables(results: dict[tuple[str, int], dict], sizes: list[int]) -> list[str]:
    ours = [
        [
            "ranks", "up s", "p50 ms", "p99 ms", "ctl CPU us", "+ relay us", "kernel CPU us",
            "100 lines s", "lines shown", "push ms", "pull ms", "1000 bcast ms",
            "idle CPU %", "idle RSS MiB", "Ctrl-C s", "store MiB",
        ]
    ]  # fmt: skip
    for n in sizes:
        r = results.get(("monarch", n))
        if r is None:
            continue
        if "error" in r:
            ours.append([str(n), f"not available: {r['error']}"])
            continue
        ours.append(
            [
                str(n), f"{r['up_s']:.2f}", _ms(r["p50"]), _ms(r["p99"]), _us(r["ctl_cpu"]),
                _us(r["with_relay_cpu"]) if r["relayed"] else "-", _us(r["proc_cpu"]),
                f"{r['print_last_s']:.2f}", f"{r['print_shown']}/{r['print_of']}",
                _ms(r["push_s"]), _ms(r["pull_s"]), _ms(r["broadcast_s"]),
                f"{100 * r['idle_cpu']:.1f}", _mb(r["idle_rss"]),
                _interrupted(r, n),
                _mb(r["store_bytes"]),
            ]
        )  # fmt: skip
    peers = [
        ["system", "ranks", "up s", "p50 ms", "p99 ms", "1000 bcast ms", "monarch-nb p50/peer"]
    ]
    for system in ("monarch", "torchmonarch", "ipyparallel"):
        for n in sizes:
            r = results.get((system, n))
            if r is None:
                continue
            if "error" in r:
                peers.append([SYSTEMS[system], str(n), f"not available: {r['error']}"])
                continue
            base = results.get(("monarch", n), {})
            ratio = (
                f"{base['p50'] / r['p50']:.2f}x" if "p50" in base and system != "monarch" else "-"
            )
            bcast = _ms(r["broadcast_s"]) if "broadcast_s" in r else "-"
            up = f"{r['up_s']:.2f}"
            peers.append([SYSTEMS[system], str(n), up, _ms(r["p50"]), _ms(r["p99"]), bcast, ratio])
    return [*_table(ours), "", *_table(peers)]


def verdicts(results: dict[tuple[str, int], dict], sizes: list[int]) -> list[str]:
    lines = []
    for key, what in (
        ("ctl_cpu", "the controller's threads"),
        ("with_relay_cpu", "the controller's threads and its relay"),
        ("proc_cpu", "the kernel process"),
    ):
        pts = [
            (n, results["monarch", n][key]) for n in sizes if key in results.get(("monarch", n), {})
        ]
        if len(pts) < 2:
            continue
        a, b = fit(pts)
        steps = ", ".join(
            f"{n0}->{n1}: {_us((y1 - y0) / (n1 - n0))}"
            for (n0, y0), (n1, y1) in itertools.pairwise(pts)
        )
        lines.append(
            f"CPU per trivial cell, {what}: {_us(a)} us + {b * 1e6:.1f} us per rank (least squares "
            f"over {pts[0][0]}-{pts[-1][0]}); per added rank between sizes, us: {steps}"
        )
        if key == "ctl_cpu":
            met = "met" if b <= PER_RANK_TARGET else "NOT met"
            lines.append(
                f"target (<= {_us(PER_RANK_TARGET)} us per added rank): {b * 1e6:.1f} us, {met}"
            )
    top = max((n for n in sizes if "p50" in results.get(("monarch", n), {})), default=None)
    peer = results.get(("torchmonarch", top), {}) if top else {}
    if top and "p50" in peer:
        ratio = results["monarch", top]["p50"] / peer["p50"]
        met = "met" if ratio <= PEER_TARGET else "NOT met"
        what = f"p50 at {top} ranks <= {PEER_TARGET:g}x torchmonarch's call()"
        lines.append(f"target ({what}): {ratio:.2f}x, {met}")
    return lines


def main(args) -> None:
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"--only: unknown system {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    leftovers.become_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed run still sweeps
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    results: dict[tuple[str, int], dict] = {}
    for n in args.ranks:
        for system in systems:
            print(f"# {SYSTEMS[system]}, {n} ranks ...", file=sys.stderr, flush=True)
            results[system, n] = run_one(system, n, args)
    lines = [
        "monarch-nb from 2 to 64 ranks",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(PACKAGES)}",
        f"load average (1 min) before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}",
        f"CPU ranks, one process each; {args.cells} timed trivial cells after {args.warmup} "
        f"warm-up; idle over {args.idle:g} s; CPU per cell in us, times as headed",
        "",
        *tables(results, args.ranks),
        "",
        *verdicts(results, args.ranks),
        f"total wall time: {time.perf_counter() - began:.0f} s",
    ]
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--cells", type=int, default=200, help="timed trivial cells per size")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--idle", type=float, default=5.0, help="seconds the idle kernel is watched")
    p.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    p.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    p.add_argument("--one", nargs=2, metavar=("SYSTEM", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def one(system: str, n: int, args) -> dict:
    if system == "monarch":
        return ranks_measure.measure_monarch(n, args.cells, args.warmup, args.idle)
    if system == "torchmonarch":
        return ranks_measure.measure_torchmonarch(n, args.cells, args.warmup)
    # ipyparallel's round trip is tens of ms at these sizes: fewer cells
    return ranks_measure.measure_ipyparallel(n, max(20, args.cells // 4), 5)


if __name__ == "__main__":
    args = parse()
    if args.one:
        fresh_process.answer(lambda: one(args.one[0], int(args.one[1]), args))
    else:
        main(args)
