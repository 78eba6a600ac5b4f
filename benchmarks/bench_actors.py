"""Actor messaging: monarch-nb's actors vs PyTorch Monarch (torchmonarch) on the same machine.

Each system and mesh size runs in a fresh subprocess (this script re-invoked with ``--one SYSTEM
N``) in its own session, which is killed afterwards so nothing one leaves behind skews the next.

    python benchmarks/bench_actors.py                     # 2 and 4 actors, 3 rounds of 300 calls
    python benchmarks/bench_actors.py --only monarch --calls 100
    python benchmarks/bench_actors.py --only monarch-api,torchmonarch   # the Monarch-API table
    python benchmarks/bench_actors.py --one torchmonarch 2   # one raw JSON line

Two tables. Messaging, monarch-nb's own actors (``monarch``: ``proc_mesh()``) against
torchmonarch:

call: ``actors.nop.call().get()`` on a one-line endpoint of every actor (round trip, blocking).
broadcast: 1,000 ``actors.nop.broadcast()`` in a row, then one ``call().get()``; the time until
that call returns (messages to one actor are handled in order, so all 1,000 have run by then)
and, apart, how long the 1,000 ``broadcast()`` calls themselves took.

Monarch API (issue 51), the same script with ``from monarch_nb.actor import ...``
(``monarch-api``) and with ``from monarch.actor import ...`` (torchmonarch), each in a fresh
process of its own (not the messaging one's):

start-up: imports done, from just before ``this_host().spawn_procs(per_host={"gpus": n})`` until
the first ``call_one()`` on a spawned actor answers (spawn_procs, spawn, first call; monarch-nb
starts its cluster there, as a script without one does); the median over the rounds.
call_one: ``actors.slice(gpus=0).nop.call_one().get()`` (round trip, blocking).
send: ``send(actors.nop, (), {}, port=port)`` to all n actors, then n ``recv.recv().get()``.

torchmonarch runs for each table that has another system in ``--only`` (for both when alone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import machine

SYSTEMS = {
    "monarch": "monarch-nb",
    "monarch-api": "monarch_nb.actor",
    "torchmonarch": "torchmonarch",
}
MESSAGING = ("monarch", "torchmonarch")
API = ("monarch-api", "torchmonarch")
API_JOB = {"monarch-api": "monarch-api", "torchmonarch": "torchmonarch-api"}  # --one's names
MARK = "BENCH_RESULT "
BROADCASTS = 1000
# issue 24: monarch-nb's call round trip at most 0.8x torchmonarch's, its 1,000 broadcasts
# (until the call after them returns) at most 0.5x
TARGET = 0.8
BROADCAST_TARGET = 0.5
# issue 51: monarch_nb.actor's start-up at most 0.8x torchmonarch's, call_one and send 0.5x
API_TARGETS = {"start-up": 0.8, "call_one": 0.5, "send": 0.5}


# -- one measurement, in its own process ---------------------------------------------------------
def _monarch(n: int):
    import monarch_nb
    from monarch_nb.actors import Actor, endpoint, proc_mesh

    class Nop(Actor):
        @endpoint
        def nop(self) -> int:
            return 0

    ctl = monarch_nb.up(workers=n, cpu=True)
    return proc_mesh().spawn("nop", Nop), ctl.down


def _torchmonarch(n: int):
    from monarch.actor import Actor, endpoint, this_host

    class Nop(Actor):
        @endpoint
        def nop(self) -> int:
            return 0

    procs = this_host().spawn_procs(per_host={"gpus": n})
    return procs.spawn("nop", Nop), lambda: procs.stop().get()


def measure(system: str, n: int, calls: int, warmup: int) -> dict:
    actors, close = (_monarch if system == "monarch" else _torchmonarch)(n)
    try:
        for _ in range(warmup):
            actors.nop.call().get()
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            actors.nop.call().get()
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(BROADCASTS):
            actors.nop.broadcast()
        sent = time.perf_counter() - t
        actors.nop.call().get()
        drained = time.perf_counter() - t
    finally:
        close()
    return {"times": times, "broadcast_send_s": sent, "broadcast_s": drained}


def measure_api(job: str, n: int, calls: int, warmup: int) -> dict:
    """The Monarch-API path: the same code with either module's names."""
    if job == "monarch-api":
        from monarch_nb.actor import Actor, Channel, endpoint, send, this_host
    else:
        from monarch.actor import Actor, Channel, endpoint, send, this_host

    class Nop(Actor):
        @endpoint
        def nop(self) -> int:
            return 0

    t = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"gpus": n})
    try:
        actors = procs.spawn("nop", Nop)
        one = actors.slice(gpus=0)
        one.nop.call_one().get()
        start = time.perf_counter() - t
        call_one = []
        for i in range(warmup + calls):
            t = time.perf_counter()
            one.nop.call_one().get()
            if i >= warmup:
                call_one.append(time.perf_counter() - t)
        port, recv = Channel.open()
        sends = []
        for i in range(warmup + calls):
            t = time.perf_counter()
            send(actors.nop, (), {}, port=port, selection="all")
            for _ in range(n):
                recv.recv().get()
            if i >= warmup:
                sends.append(time.perf_counter() - t)
    finally:
        procs.stop().get()
    return {"start_s": [start], "call_one": call_one, "send": sends}


# -- the driver ----------------------------------------------------------------------------------
def run_one(system: str, n: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, str(n)]
    cmd += ["--calls", str(args.calls), "--warmup", str(args.warmup)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.communicate()
        return {"error": f"timed out after {args.timeout:.0f} s"}
    _kill_session(proc.pid)
    for line in out.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {"error": tail[:160]}


def _pool(before: dict | None, now: dict) -> dict:
    """All rounds' call times together; broadcast times: the median round (the lower of two)."""
    if before is None or "error" in before:
        return {**now, "bcast": [now]} if "error" not in now else now
    if "error" in now:
        return before
    rounds = sorted([*before["bcast"], now], key=lambda r: r["broadcast_s"])
    mid = rounds[(len(rounds) - 1) // 2]
    return {
        "times": before["times"] + now["times"],
        "broadcast_s": mid["broadcast_s"],
        "broadcast_send_s": mid["broadcast_send_s"],
        "bcast": rounds,
    }


def _pool_api(before: dict | None, now: dict) -> dict:
    """Every round's start-up and round trips together."""
    if before is None or "error" in before:
        return now
    if "error" in now:
        return before
    return {k: before[k] + now[k] for k in ("start_s", "call_one", "send")}


def _kill_session(pid: int) -> None:
    """Whatever the measurement left running in its session (worker processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        if len(row) < len(widths):  # "not available": the message runs on from column 3
            out.append("  ".join([row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2]]))
            continue
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        out.append("  ".join(cells))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _tables(systems: list[str]) -> list[tuple[str, ...]]:
    """The tables ``--only`` asks for: each with a system besides torchmonarch, or both."""
    own = [t for t in (MESSAGING, API) if any(s in systems and s != "torchmonarch" for s in t)]
    return own or [MESSAGING, API]


def main(args) -> None:
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        sys.exit(f"--only: unknown system {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    tables = _tables(systems)
    # (table, system, job): the job is --one's name, a fresh process each
    jobs = [(t, s, s if t is MESSAGING else API_JOB[s]) for t in tables for s in systems if s in t]
    began = time.perf_counter()
    results = {}
    for n in args.actors:
        for round_ in range(args.rounds):  # alternate, so a busy spell hits both systems
            for table, system, job in jobs:
                what = "" if table is MESSAGING else " (Monarch API)"
                print(
                    f"# {SYSTEMS[system]}{what}, {n} actors, round {round_ + 1}/{args.rounds} ...",
                    file=sys.stderr,
                    flush=True,
                )
                pool = _pool if table is MESSAGING else _pool_api
                results[job, n] = pool(results.get((job, n)), run_one(job, n, args))

    lines = [
        "monarch-nb actor messaging benchmark",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(('torch', 'monarch-nb', 'distributed', 'torchmonarch'))}",
    ]
    if MESSAGING in tables:
        lines += _messaging_lines([s for s in systems if s in MESSAGING], results, args)
    if API in tables:
        lines += _api_lines([s for s in systems if s in API], results, args)
    lines.append(f"total wall time: {time.perf_counter() - began:.0f} s")
    print("\n".join(lines))


def _messaging_lines(systems: list[str], results: dict, args) -> list[str]:
    rows = [
        [
            "system",
            "actors",
            "call median ms",
            "call p90 ms",
            "monarch-nb/peer",
            "1000 broadcasts ms",
            "send only ms",
            "monarch-nb/peer",
        ]
    ]
    verdicts = []
    for n in args.actors:
        peer = results.get(("torchmonarch", n), {})
        for system in systems:
            r = results[system, n]
            if "error" in r:
                rows.append([SYSTEMS[system], str(n), f"not available: {r['error']}"])
                continue
            med = statistics.median(r["times"])
            p90 = _p90(r["times"])
            call_ratio = bcast_ratio = "-"
            if system == "monarch" and "times" in peer:
                ratio = med / statistics.median(peer["times"])
                call_ratio = f"{ratio:.2f}x"
                bcast_ratio = f"{r['broadcast_s'] / peer['broadcast_s']:.2f}x"
                verdicts.append((n, ratio, r["broadcast_s"] / peer["broadcast_s"]))
            rows.append(
                [
                    SYSTEMS[system],
                    str(n),
                    f"{med * 1e3:.3f}",
                    f"{p90 * 1e3:.3f}",
                    call_ratio,
                    f"{r['broadcast_s'] * 1e3:.1f}",
                    f"{r['broadcast_send_s'] * 1e3:.1f}",
                    bcast_ratio,
                ]
            )
        if len(systems) > 1 and not any(v[0] == n for v in verdicts):
            verdicts.append((n, None, None))
    lines = [
        f"call: {args.calls} timed round trips after {args.warmup} warm-up to every actor of the "
        f"mesh, in each of {args.rounds} rounds (fresh clusters, the systems alternating), pooled",
        f"broadcast: {BROADCASTS} broadcasts then one call, until that call returns and the "
        "broadcast() calls alone; the median round; times in ms",
        "",
        *_table(rows),
        "",
    ]
    for n, ratio, bcast in verdicts:
        for what, most, got in (("call", TARGET, ratio), ("broadcasts", BROADCAST_TARGET, bcast)):
            lines.append(_verdict(what, most, n, got))
    return lines


def _api_lines(systems: list[str], results: dict, args) -> list[str]:
    """The Monarch-API table: monarch_nb.actor against torchmonarch, by the same script."""
    head = ["system", "actors", "start-up s", "nb/peer", "call_one median ms", "call_one p90 ms"]
    rows = [[*head, "nb/peer", "send median ms", "send p90 ms", "nb/peer"]]
    verdicts = []
    for n in args.actors:
        peer = results.get(("torchmonarch-api", n), {})
        for system in systems:
            r = results[API_JOB[system], n]
            if "error" in r:
                rows.append([SYSTEMS[system], str(n), f"not available: {r['error']}"])
                continue
            got = {k: statistics.median(r[k]) for k in ("start_s", "call_one", "send")}
            ratios = dict.fromkeys(API_TARGETS)
            if system == "monarch-api" and "send" in peer:
                for name, key in zip(API_TARGETS, ("start_s", "call_one", "send"), strict=True):
                    ratios[name] = got[key] / statistics.median(peer[key])
            shown = {k: "-" if v is None else f"{v:.2f}x" for k, v in ratios.items()}
            rows.append(
                [
                    SYSTEMS[system],
                    str(n),
                    f"{got['start_s']:.2f}",
                    shown["start-up"],
                    f"{got['call_one'] * 1e3:.3f}",
                    f"{_p90(r['call_one']) * 1e3:.3f}",
                    shown["call_one"],
                    f"{got['send'] * 1e3:.3f}",
                    f"{_p90(r['send']) * 1e3:.3f}",
                    shown["send"],
                ]
            )
            if system == "monarch-api" and len(systems) > 1:
                verdicts.append((n, ratios))
        if len(systems) > 1 and not any(v[0] == n for v in verdicts):
            verdicts.append((n, dict.fromkeys(API_TARGETS)))
    lines = [
        "",
        "Monarch API (issue 51): the same script importing from monarch_nb.actor or from "
        "monarch.actor (torchmonarch), in processes of their own (not the messaging ones)",
        f"start-up: this_host().spawn_procs(per_host={{'gpus': n}}), spawn, first call_one; "
        f"the median of {args.rounds} rounds (fresh processes, the systems alternating)",
        f"call_one: {args.calls} timed round trips to actors.slice(gpus=0) after {args.warmup} "
        f"warm-up; send: {args.calls} times send(actors.nop, (), {{}}, port=port) to all n actors "
        "then n recv.recv().get(); every round's pooled; times in ms",
        "",
        *_table(rows),
        "",
    ]
    for n, ratios in verdicts:
        for what, most in API_TARGETS.items():
            lines.append(_verdict(what, most, n, ratios[what]))
    return lines


def _p90(times: list[float]) -> float:
    return statistics.quantiles(times, n=10, method="inclusive")[-1] if len(times) > 1 else times[0]


def _verdict(what: str, most: float, n: int, got: float | None) -> str:
    head = f"target ({what} <= {most:g}x torchmonarch), {n} actors"
    if got is None:
        return f"{head}: not measured"
    return f"{head}: {got:.2f}x, {'met' if got <= most else 'NOT met'}"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="fresh runs per system and size")
    p.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    p.add_argument("--timeout", type=float, default=240, help="seconds per measurement")
    p.add_argument("--one", nargs=2, metavar=("SYSTEM", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.one:
        job, n = args.one[0], int(args.one[1])
        how = measure_api if job in API_JOB.values() else measure
        print(MARK + json.dumps(how(job, n, args.calls, args.warmup)), flush=True)
    else:
        main(args)
