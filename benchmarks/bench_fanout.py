"""A trivial cell's round trip and the controller's CPU per rank against stand-in ranks, from 8
to 64 on this host and from 128 to 1,024 on 16 simulated hosts (issue 52's simulation): the
relays on every host, against the direct links.

The controller's side is the product's own (fanout_ctl.py: links, Reader, Router, the relays,
submit, gather, settle); the ranks are stand-ins (fanout_standin.py), one process per
PER_HOST ranks as one per host. Kinds of run:

- ``direct``: each rank's own Unix-domain socket, as for engines on the controller's host,
  with the local relay kept off (relaying.RELAY_FROM raised past any size here);
- ``relay``: the same with the product's RELAY_FROM (16): from 16 ranks the requests go
  through the local relay (dispatch/relaying.py), the replies still come back per rank;
- ``tcp``: each rank's TCP socket, as for engines on other hosts, and no relay;
- ``far``: each stand-in process at a loopback address of its own, as a host of its own,
  reached through the relay started there (dispatch/host_relays.py, relay/host.py);
- ``real``: real engines, ``monarch_nb.up(workers=N, cpu=True, dist=False)``, one Dask worker
  process each, beside the stand-ins at the same sizes, to show how far the stand-in carries;
- ``netns``: NETNS_HOSTS simulated hosts, each a network namespace holding one stand-in
  process (fanout_netns.py), reached by TCP as other machines are, with the host relays off:
  the direct links, one TCP connection per rank;
- ``hosts``: the same hosts, each reached through the relay started in its namespace.
  After the cells of ``netns`` and ``hosts``, the last host's link is taken down while its
  ranks are busy: the seconds until the cell ends, failed on that host's ranks alone. Both
  need root; "not available" otherwise.

Every kind and size runs in a fresh process (this script re-invoked with ``--one KIND N``).
The cell is ``x = 1`` (bench_dispatch.py's); ``ctl.run`` until every rank has answered.
The controller's CPU is its own threads' (ranks_measure.CpuMeter: the notebook's thread, the
Reader's, its writers'; not the event loop's, nor, for ``real``, Dask's scheduler and nannies
in the same process), per cell and per cell per rank; the relays' and the stand-ins', processes
of their own, beside it. They all share the machine's cores, so the round trips include their
turns: on 2 cores a round trip is at least the sum of the three columns over 2. With the
stand-ins, after the cells: an interrupt of every rank (as Ctrl-C sends it) until the last rank
noted it, and whether every rank printing the same line shows as one line.

    python benchmarks/bench_fanout.py                       # every kind
    python benchmarks/bench_fanout.py --ranks 8 16 --kinds direct tcp --cells 100
    python benchmarks/bench_fanout.py --kinds netns hosts --netns-hosts 16 --netns-ranks 8 64
    python benchmarks/bench_fanout.py --one direct 8        # one raw JSON line
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import fresh_process
import machine
import orphans as leftovers
from ranks_measure import CpuMeter

from monarch_nb.dispatch.relaying import RELAY_FROM
from monarch_nb.dispatch.results import CellError

KINDS = ("direct", "relay", "tcp", "far", "real", "netns", "hosts")
PER_HOST = 16  # stand-in ranks per process (per simulated host)
CELL = "x = 1"
PACKAGES = ("monarch-nb", "dask", "distributed")


# -- one measurement, in its own process ----------------------------------------------------------
@contextlib.contextmanager
def cluster(kind: str, n: int, per_host: int, netns_hosts: int):
    """A controller over ``n`` ranks of ``kind``, how many hosts hold them and, on namespace
    hosts, ``cut(i)`` that takes host i's link down (else None); closed after."""
    if kind == "real":
        import monarch_nb

        ctl = monarch_nb.up(workers=n, cpu=True, dist=False, current=False)
        try:
            yield ctl, 1, None
        finally:
            ctl.down()
        return
    from fanout_ctl import Controller, Host

    from monarch_nb.dispatch import host_relays, relaying

    if kind in ("direct", "tcp"):
        relaying.RELAY_FROM = 1 << 30  # the baseline: no relay, whatever the size
    if kind == "netns":
        host_relays.HOST_RELAY_FROM = 1 << 30  # the direct links, as before the host relays
    with contextlib.ExitStack() as stack:
        if kind in ("netns", "hosts"):
            import fanout_netns

            if (why := fanout_netns.why_not()) is not None:
                raise RuntimeError(why)
            hosts, cut = stack.enter_context(fanout_netns.hosts(netns_hosts, n // netns_hosts))
        else:
            cut = None
            sizes = [min(per_host, n - start) for start in range(0, n, per_host)]
            hosts = []
            stack.callback(lambda: [host.close() for host in hosts])
            for i, size in enumerate(sizes):
                if kind == "far":  # a loopback address of its own, as a host of its own
                    hosts.append(Host(size, f"127.0.0.{2 + i}", far=True))
                else:
                    hosts.append(Host(size, tcp_only=kind == "tcp"))
        ctl = Controller(hosts)
        stack.callback(ctl.close)
        yield ctl, len(hosts), cut


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``'s main thread, to the nanosecond (the relay has one
    thread; psutil's figures move in 10 ms ticks, more than the relay uses for 200 cells)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``, all its threads, user and system (in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lost_host(ctl, hosts: int, cut) -> float:
    """Seconds from the last host's link going down, mid-cell, to the cell's end: the ranks
    there busy (a stand-in's cells run one after another, so its host is), the others done.
    Checks that the cell failed on that host's ranks alone, each WorkerLost."""
    n = len(ctl.ranks)
    first = n - n // hosts
    at: list[float] = []
    timer = threading.Timer(1.0, lambda: (at.append(time.monotonic()), cut(hosts - 1)))
    timer.start()
    try:
        ctl.run(f"import time\nif rank >= {first}:\n    time.sleep(60)\nrank", timeout=90)
    except CellError as e:
        took = time.monotonic() - at[0]
        lost = sorted(r for r, err in e.errors.items() if err.ename == "WorkerLost")
        if lost != list(range(first, n)) or len(e.errors) != len(lost):
            raise RuntimeError(f"the cut host's cell failed on {sorted(e.errors)}") from None
        return took
    finally:
        timer.cancel()
    raise RuntimeError("the cell on the cut host did not fail")


def interrupt_all(ctl) -> float:
    """Seconds from an interrupt of every rank (dispatch.send_interrupt, as Ctrl-C sends it)
    until the last rank has it, by either of its paths, as the stand-ins noted its arrival."""
    from monarch_nb.dispatch import dispatch

    t0 = time.time()
    key = dispatch.send_interrupt(ctl, ctl.targets())
    deadline = time.monotonic() + 30
    while True:
        heard = [host.heard(key) for host in ctl.hosts]
        if all(
            count == len(host.addresses) for (count, _), host in zip(heard, ctl.hosts, strict=True)
        ):
            return max(last for _, last in heard) - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"the interrupt reached {sum(c for c, _ in heard)} ranks in 30 s")
        time.sleep(0.05)


def one_line(ctl, n: int) -> bool:
    """Whether every rank printing the same line shows as that line once, tagged by them all."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ctl.run("print('the same line')")
    shown = [line for line in out.getvalue().splitlines() if line.endswith("the same line")]
    return shown == [f"[ranks 0-{n - 1}] the same line"]


def measure(kind: str, n: int, args) -> dict:
    with cluster(kind, n, args.per_host, args.netns_hosts) as (ctl, hosts, cut):
        got = ctl.run(CELL)
        if len(got) != n:
            raise RuntimeError(f"{len(got)} of {n} ranks answered")
        for _ in range(args.warmup):
            ctl.run(CELL)
        relays = [ctl._relay.proc.pid] if ctl._relay is not None else []
        relays += [pid for host in getattr(ctl, "hosts", []) for pid in host.relays]
        relay_before = sum(map(_cpu_s, relays))
        standins = [host.pid for host in getattr(ctl, "hosts", [])]
        standins_before = sum(map(_process_cpu_s, standins))
        meter = CpuMeter()
        meter.start()
        times = []
        for _ in range(args.cells):
            t = time.perf_counter()
            ctl.run(CELL)
            times.append(time.perf_counter() - t)
        cpu = meter.stop()
        relay_cpu = sum(map(_cpu_s, relays)) - relay_before if relays else None
        standin_cpu = sum(map(_process_cpu_s, standins)) - standins_before if standins else None
        interrupt = interrupt_all(ctl) if standins else None
        merged = one_line(ctl, n) if standins else None
        lost = lost_host(ctl, hosts, cut) if cut is not None else None
    return {
        "lost_host": lost,
        "interrupt": interrupt,
        "merged": merged,
        "hosts": hosts,
        "relayed": bool(relays),
        "p50": statistics.median(times),
        "p90": statistics.quantiles(times, n=10, method="inclusive")[-1],
        "ctl_cpu": cpu["controller"] / args.cells,
        "relay_cpu": None if relay_cpu is None else relay_cpu / args.cells,
        "standin_cpu": None if standin_cpu is None else standin_cpu / args.cells,
    }


# -- the driver ----------------------------------------------------------------------------------
def run_one(kind: str, n: int, args) -> dict:
    """One measurement in a fresh process; ``{"error": ...}`` rather than an exception."""
    argv = ["--one", kind, str(n)]
    argv += ["--cells", str(args.cells), "--warmup", str(args.warmup)]
    argv += ["--per-host", str(args.per_host), "--netns-hosts", str(args.netns_hosts)]
    return fresh_process.run(os.path.abspath(__file__), argv, args.timeout)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def table(results: dict[tuple[str, int], dict]) -> list[str]:
    head = ["kind", "ranks", "hosts", "relay", "p50 ms", "p90 ms", "ctl CPU/cell us"]
    head += ["ctl CPU/cell/rank us", "relay CPU/cell us", "stand-ins CPU/cell us"]
    head += ["interrupt to every rank s"]
    head += ["one merged line", "a host lost, named in s"]
    rows = [head, ["---"] * len(head)]
    for (kind, n), r in results.items():
        if "error" in r:
            rows.append([kind, str(n), "", "", f"not available: {r['error']}", *[""] * 8])
            continue
        rows.append(
            [
                kind,
                str(n),
                str(r["hosts"]),
                "yes" if r["relayed"] else "no",
                f"{r['p50'] * 1e3:.2f}",
                f"{r['p90'] * 1e3:.2f}",
                _us(r["ctl_cpu"]),
                _us(r["ctl_cpu"] / n),
                _us(r["relay_cpu"]),
                _us(r.get("standin_cpu")),
                "-" if r.get("interrupt") is None else f"{r['interrupt']:.3f}",
                "-" if r.get("merged") is None else "yes" if r["merged"] else "NO",
                "-" if r.get("lost_host") is None else f"{r['lost_host']:.2f}",
            ]
        )
    return ["| " + " | ".join(row) + " |" for row in rows]


def slopes(results: dict[tuple[str, int], dict], kinds: list[str]) -> list[str]:
    """The controller's CPU per added rank, fitted (least squares) over each kind's sizes."""
    out = []
    for kind in kinds:
        points = [
            (n, r["ctl_cpu"]) for (k, n), r in results.items() if k == kind and "error" not in r
        ]
        if len(points) < 2:
            continue
        xs, ys = zip(*points, strict=True)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
        out.append(
            f"- {kind}: {slope * 1e6:.2f} us of controller CPU per added rank "
            f"({min(xs)} -> {max(xs)} ranks)"
        )
    return out


def _said(kind: str, args) -> str:
    """What a kind of run is, in the table's heading."""
    one_host = f"{args.per_host} stand-in ranks per process, all on 127.0.0.1"
    return {
        "direct": f"{one_host}, Unix-domain sockets, the local relay off",
        "relay": f"{one_host}, Unix-domain sockets, the local relay from "
        f"{RELAY_FROM} ranks (the product as it is)",
        "tcp": f"{one_host}, TCP (as other hosts' ranks are reached), no relay",
        "real": "real engines, monarch_nb.up(workers=N, cpu=True, dist=False)",
        "far": f"{args.per_host} stand-in ranks per process, each process at a loopback "
        "address of its own (127.0.0.2, .3, ...) as a host of its own, reached through a relay "
        "started on it (dispatch/host_relays.py)",
        "netns": f"{args.netns_hosts} network namespaces on one bridge, one stand-in process "
        "each, reached by TCP, no relay (the direct links)",
        "hosts": f"the same {args.netns_hosts} namespaces, each host's ranks reached through a "
        "relay started in its namespace (dispatch/host_relays.py)",
    }[kind]


def plan(args) -> list[tuple[str, int]]:
    """(kind, ranks) in the order they run: the stand-ins at every size (the real engine's
    too, for the side by side), the real engine at its own sizes."""
    runs = []
    for kind in args.kinds:
        if kind in ("netns", "hosts"):
            sizes = [args.netns_hosts * k for k in args.netns_ranks]
        elif kind == "real":
            sizes = args.real
        else:
            sizes = sorted(set(args.ranks) | set(args.real))
        runs += [(kind, n) for n in sizes]
    return runs


def main(args) -> None:
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        sys.exit(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    leftovers.become_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed run still sweeps
    results = {}
    for kind, n in plan(args):
        print(f"... {kind} at {n} ranks", file=sys.stderr, flush=True)
        results[(kind, n)] = run_one(kind, n, args)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "A trivial cell (`x = 1`) through the product's dispatch. SIMULATED: but for `real`, "
        "the ranks are stand-ins (benchmarks/fanout_standin.py), one process per host.",
        *(f"- {kind}: {_said(kind, args)}" for kind in args.kinds),
        f"machine: {machine.cpu()}; commit {commit or 'unknown'}",
        machine.versions(PACKAGES),
        f"{args.cells} cells after {args.warmup} warm-up; CPU: the controller's own threads",
        "",
        *table(results),
        "",
        *slopes(results, [k for k in args.kinds if k != "real"]),
    ]
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--real", type=int, nargs="*", default=[4], help="real engines' sizes")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), help=", ".join(KINDS))
    p.add_argument("--cells", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--per-host", type=int, default=PER_HOST, help="ranks per stand-in process")
    p.add_argument("--netns-hosts", type=int, default=16, help="namespaces, for kind netns")
    p.add_argument(
        "--netns-ranks", type=int, nargs="+", default=[8, 16, 32, 64], help="ranks per namespace"
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    p.add_argument("--one", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.one:
        fresh_process.answer(lambda: measure(args.one[0], int(args.one[1]), args))
    else:
        main(args)
