"""Where the time goes: a trivial cell's round trip, start-up, and an idle cluster's CPU.

    python benchmarks/bench_breakdown.py                  # 2 and 4 workers, 300 cells each
    python benchmarks/bench_breakdown.py --workers 4 --cells 100 --idle 10

Round trip: ``ctl.run("x = 1")`` on every worker, with ``time.perf_counter_ns`` stamps taken at
the seams (after the controller's send on each rank's link; on the rank when its thread has the
request, after compiling, once output capture is set up, around the user code, after capture is
torn down, around the reply's send; on the controller when the reader thread routes the reply,
and when ``run`` returns). The stamps come from wrappers this script installs in the running
controller and workers, so the package carries no instrumentation; ``perf_counter`` is
CLOCK_MONOTONIC, one clock for every process on the machine. The wrappers cost a little
themselves: the instrumented total is printed beside the plain one, measured before them.

The socket floor: one process sends three bytes to each of 2 / 4 processes over loopback TCP and
waits for every echo (each child blocked in ``recv``, as a rank's thread waits in ``select``);
the issue's floor. The same over Unix-domain sockets is printed beside it: a local cluster's
data path uses them (wire.Listeners).

Beyond the floor: the round trip of a lean client that writes and reads the controller's data
sockets itself, against monarch-nb's engines and against a minimal exec server in each worker
process (exec_floor.py), which splits what a cell takes beyond the floor into the controller's
share and the rank's.

CPU per cell: the user and system CPU time of the controller's process and of each worker
process over ``--cpu-cells`` plain round trips (psutil ``cpu_times``), and the least wall time
that much CPU needs on this machine's cores.

Start-up: ``monarch_nb.up`` with its steps timed by wrappers in this process (starting the
scheduler, nannies and worker processes; the client; the engine plugin; waiting for and
attaching to the workers; the process group), then a first cell's ``import torch``; beside it,
what one bare Python process spends importing what a worker imports, alone and N at once.

Idle: the CPU time of every worker and nanny process over ``--idle`` seconds of an idle cluster
(psutil ``cpu_times``), as % of one core per worker; the notebook's process (scheduler, client,
reader) apart.
"""

from __future__ import annotations

import argparse
import functools
import os
import selectors
import socket
import statistics
import subprocess
import sys
import time

import cpu_use
import exec_floor
import machine

PACKAGES = ("torch", "monarch-nb", "dask", "distributed")
FLOOR_TARGET = 5.0  # the issue: each round trip within 5x the socket floor
IDLE_TARGET = 1.0  # % of a core per worker
now_ns = time.perf_counter_ns


# -- the socket floor ---------------------------------------------------------------------------
_ECHO = """
import socket, sys
where = sys.argv[1]
if where.isdigit():
    s = socket.create_connection(("127.0.0.1", int(where)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
else:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0" + where)
while True:
    b = s.recv(64)
    if not b:
        break
    s.sendall(b)
"""


def socket_floor(n: int, reps: int, unix: bool = False) -> list[float]:
    """Round trips (ms) of three bytes to ``n`` echoing processes, waiting for every echo: over
    loopback TCP (the issue's floor), or ``unix`` over Unix-domain sockets (what a local
    cluster's data path now uses: wire.Listeners)."""
    if unix:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = f"monarch-nb-floor-{os.getpid()}"
        server.bind("\0" + where)
        server.listen()
    else:
        server = socket.create_server(("127.0.0.1", 0))
        where = str(server.getsockname()[1])
    procs = [
        subprocess.Popen([sys.executable, "-c", _ECHO, where], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        conns = [server.accept()[0] for _ in range(n)]
        sel = selectors.DefaultSelector()
        for c in conns:
            if not unix:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sel.register(c, selectors.EVENT_READ)
        times = []
        for i in range(reps + reps // 10):
            t = now_ns()
            for c in conns:
                c.sendall(b"abc")
            got = 0
            while got < 3 * n:
                for key, _ in sel.select():
                    got += len(key.fileobj.recv(64))
            if i >= reps // 10:  # the first tenth warms up
                times.append((now_ns() - t) / 1e6)
        for c in conns:
            c.close()
        return times
    finally:
        server.close()
        for p in procs:
            p.wait(timeout=10)


# -- stamps on the rank (installed there by ctl.call) -------------------------------------------
def _install_rank_stamps(engine) -> int:
    """Wrap the seams of this rank's cell path with stamps kept in ``engine._bench_stamps``
    (request id -> [(name, ns)]); returns the rank's pid."""
    import contextlib as cl
    import os as _os
    import time as _time

    from monarch_nb.rank import engine as engine_mod

    ns = _time.perf_counter_ns
    stamps: dict = {}
    engine._bench_stamps = stamps
    current = {"id": None}

    def mark(name):
        if current["id"] is not None:
            stamps.setdefault(current["id"], []).append((name, ns()))

    next_request = engine.wire.next_request

    def stamped_next():
        channel, msg = next_request()
        current["id"] = msg.get("id")
        mark("taken")
        return channel, msg

    compile_cell = engine_mod.compile_cell

    def stamped_compile(msg):
        mark("compile0")
        try:
            return compile_cell(msg)
        finally:
            mark("compiled")

    running = engine.console.running

    @cl.contextmanager
    def stamped_running(outbox, cid):
        mark("capture0")
        with running(outbox, cid):
            mark("captured")
            yield
            mark("uncapture0")
        mark("uncaptured")

    run_user = engine._run_user

    def stamped_run_user(fn):
        mark("user0")
        try:
            return run_user(fn)
        finally:
            mark("user1")

    engine.wire.next_request = stamped_next
    engine_mod.compile_cell = stamped_compile
    engine.console.running = stamped_running
    engine._run_user = stamped_run_user
    for channel in engine.wire.channels.values():
        reply = channel.reply

        def stamped_reply(event, reply=reply):
            mark("reply0")
            reply(event)
            mark("replied")

        channel.reply = stamped_reply
    return _os.getpid()


def _take_rank_stamps(engine) -> dict:
    stamps = dict(engine._bench_stamps)
    engine._bench_stamps.clear()
    return stamps


def _install_controller_stamps(ctl) -> dict:
    """Stamps of the controller's sends and of the reader routing each reply."""
    sent: dict = {}  # (request id, rank) -> ns after the send
    done: dict = {}  # (request id, rank) -> ns when the reply was routed
    for rank, link in ctl._links.items():
        send = link.send

        def stamped_send(msg, send=send, rank=rank):
            send(msg)
            sent[msg.get("id"), rank] = now_ns()

        link.send = stamped_send
    deliver = ctl._router.deliver

    def stamped_deliver(rank, ev):
        if ev.get("ev") == "done":
            done[ev.get("id"), rank] = now_ns()
        deliver(rank, ev)

    ctl._router.deliver = stamped_deliver
    return {"sent": sent, "done": done}


# (segment name, from stamp, to stamp); "c0"/"c1": ctl.run called/returned
SEGMENTS = [
    ("controller: parse, submit, send", "c0", "sent"),
    ("wire out + rank thread wake-up", "sent", "taken"),
    ("rank: request taken -> compile", "taken", "compile0"),
    ("rank: compile", "compile0", "compiled"),
    ("rank: output capture set-up", "capture0", "captured"),
    ("rank: __main__ swap + interrupt guard", "captured", "user0"),
    ("rank: user code (x = 1)", "user0", "user1"),
    ("rank: output capture tear-down", "uncapture0", "uncaptured"),
    ("rank: end of cell, result, reply made", "uncaptured", "reply0"),
    ("rank: reply sent (pickle, sendall)", "reply0", "replied"),
    ("wire back + controller reader wake-up", "replied", "done"),
    ("controller: gather, settle after last reply", "done", "c1"),
]


def round_trip(ctl, cells: int, warmup: int) -> tuple[list[float], dict[str, list[float]]]:
    plain = []
    for _ in range(warmup):
        ctl.run("x = 1")
    for _ in range(cells):
        t = now_ns()
        ctl.run("x = 1")
        plain.append((now_ns() - t) / 1e6)
    ctl.call(_install_rank_stamps)
    cstamps = _install_controller_stamps(ctl)
    runs = []
    for _ in range(warmup + cells):
        before = set(cstamps["sent"])
        c0 = now_ns()
        ctl.run("x = 1")
        c1 = now_ns()
        ids = {i for i, _ in set(cstamps["sent"]) - before}
        runs.append((ids.pop(), c0, c1))
    rank_stamps = ctl.call(_take_rank_stamps).to_dict()
    ranks = sorted(ctl._links)
    pieces: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    pieces["total (instrumented)"] = []
    for rid, c0, c1 in runs[warmup:]:
        per_rank = []
        for rank in ranks:
            s = dict(rank_stamps[rank].get(rid, []))
            s["c0"], s["c1"] = c0, c1
            s["sent"] = cstamps["sent"].get((rid, rank))
            s["done"] = cstamps["done"].get((rid, rank))
            per_rank.append(s)
        for name, a, b in SEGMENTS:
            # a rank's piece: the slowest rank's, since the cell waits for every rank
            spans = [s[b] - s[a] for s in per_rank if s.get(a) and s.get(b)]
            if name.startswith("controller: gather"):
                spans = [c1 - max(s["done"] for s in per_rank)]
            if spans:
                pieces[name].append(max(spans) / 1e6)
        pieces["total (instrumented)"].append((c1 - c0) / 1e6)
    return plain, pieces


# -- start-up -------------------------------------------------------------------------------------
def _wrap(owner, name: str, label: str, into: dict) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = now_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            into[label] = into.get(label, 0.0) + (now_ns() - t) / 1e6

    setattr(owner, name, timed)


def start_up(n: int):
    """(controller, {step: ms}) for ``monarch_nb.up(workers=n, cpu=True)``."""
    t = now_ns()
    import distributed

    import monarch_nb
    from monarch_nb.controller import attach, cluster, controller
    from monarch_nb.telemetry import metrics

    steps = {"controller imports (not in start-up)": (now_ns() - t) / 1e6}
    _wrap(cluster, "start_local", "scheduler + nannies + worker processes (start_local)", steps)
    _wrap(distributed.Client, "register_plugin", "engine plugin registered on workers", steps)
    _wrap(metrics, "install", "telemetry installed", steps)
    _wrap(attach, "wait_for_workers", "waiting for the workers", steps)
    _wrap(attach, "attach_all", "handshake with every engine", steps)
    _wrap(controller.Controller, "_form_group", "process group formed", steps)
    t = now_ns()
    ctl = monarch_nb.up(workers=n, cpu=True)
    up_ms = (now_ns() - t) / 1e6
    t = now_ns()
    ctl.run("import torch")
    steps["first cell: import torch"] = (now_ns() - t) / 1e6
    steps["rest of up (client, dashboard, registry)"] = up_ms - sum(
        v for k, v in steps.items() if not k.startswith(("controller imports", "first cell"))
    )
    steps["total until a cell can import torch"] = up_ms + steps["first cell: import torch"]
    return ctl, steps


_IMPORTS = "import distributed, monarch_nb.rank.engine, torch"


def import_cost(n: int) -> tuple[float, float]:
    """Wall ms of a bare Python process importing what a worker imports: one alone, and the
    slowest of ``n`` started at once."""

    def batch(k: int) -> float:
        t = now_ns()
        procs = [
            subprocess.Popen([sys.executable, "-c", _IMPORTS], stdin=subprocess.DEVNULL)
            for _ in range(k)
        ]
        for p in procs:
            p.wait()
        return (now_ns() - t) / 1e6

    return batch(1), batch(n)


# -- the report ---------------------------------------------------------------------------------
def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def measure(n: int, args) -> list[str]:
    lines = [f"== {n} workers (load average before: {os.getloadavg()[0]:.2f})", ""]
    floor = socket_floor(n, args.floor_reps)
    unix_floor = socket_floor(n, args.floor_reps, unix=True)
    ctl, steps = start_up(n)
    try:
        # before round_trip installs its stamps, which cost CPU of their own
        cpu = cpu_use.cpu_per_cell(ctl, args.cpu_cells, args.warmup) if args.cpu_cells > 0 else None
        lean = exec_floor.lean_client(ctl, args.cells, args.warmup)
        minimal = exec_floor.exec_floor(ctl, args.cells, args.warmup)
        plain, pieces = round_trip(ctl, args.cells, args.warmup)
        idle = cpu_use.idle_cpu(ctl, args.idle) if args.idle > 0 else None
    finally:
        ctl.down()
    alone, together = import_cost(n)
    p50 = statistics.median(plain)
    fl = statistics.median(floor)
    lines.append(f"Trivial cell round trip, {args.cells} cells; ms (a rank's piece: the slowest)")
    rows = [["piece", "p50", "p90", "share of p50 total"]]
    total = statistics.median(pieces["total (instrumented)"])
    for name, xs in pieces.items():
        if xs:
            share = (
                "" if name.startswith("total") else f"{100 * statistics.median(xs) / total:.0f}%"
            )
            rows.append([name, f"{statistics.median(xs):.3f}", f"{_p(xs, 0.9):.3f}", share])
    rows.append(["total (plain, before the stamps)", f"{p50:.3f}", f"{_p(plain, 0.9):.3f}", ""])
    rows.append([f"socket floor, 1 -> {n} processes", f"{fl:.3f}", f"{_p(floor, 0.9):.3f}", ""])
    ufl = statistics.median(unix_floor)
    rows.append(["same over Unix-domain sockets", f"{ufl:.3f}", f"{_p(unix_floor, 0.9):.3f}", ""])
    lines += _rows(rows)
    met = "met" if p50 <= FLOOR_TARGET * fl else "NOT met"
    lines += [
        f"round trip / socket floor: {p50 / fl:.1f}x (target <= {FLOOR_TARGET:g}x: {met}); "
        f"/ the Unix-domain floor: {p50 / ufl:.1f}x",
        "",
    ]
    lines.append(f"Beyond the socket floor, {args.cells} cells; ms (exec_floor.py)")
    rows = [["round trip", "p50", "p90", "/ socket floor"]]
    for name, xs in (
        (f"socket floor, 1 -> {n} processes", floor),
        ("exec floor: a minimal server in each worker", minimal),
        ("a lean client, monarch-nb's engines", lean),
        ("monarch-nb (ctl.run)", plain),
    ):
        m = statistics.median(xs)
        rows.append([name, f"{m:.3f}", f"{_p(xs, 0.9):.3f}", f"{m / fl:.1f}x"])
    lines += [*_rows(rows), ""]
    if cpu is not None:
        lines.append(f"CPU time per trivial cell, {args.cpu_cells} cells; ms")
        rows = [["process", "user", "system", "total"]]
        for k, (user, system) in cpu.items():
            rows.append([k, f"{user:.3f}", f"{system:.3f}", f"{user + system:.3f}"])
        whole = sum(u + s for u, s in cpu.values())
        rows.append(["all of them", "", "", f"{whole:.3f}"])
        lines += _rows(rows)
        cores = len(os.sched_getaffinity(0))
        lines += [
            f"on {cores} cores a round trip takes at least {whole / cores:.3f} ms of wall time "
            "for that CPU time",
            "",
        ]
    lines.append("Start-up, ms")
    rows = [["step", "ms"]] + [[k, f"{v:.0f}"] for k, v in steps.items()]
    rows.append([f"bare python: {_IMPORTS}, 1 process", f"{alone:.0f}"])
    rows.append([f"same, {n} processes at once (the slowest)", f"{together:.0f}"])
    lines += _rows(rows)
    if idle is not None:
        lines += ["", f"Idle cluster, {args.idle:g} s; % of one core"]
        lines += _rows([["process", "%"]] + [[k, f"{v:.2f}"] for k, v in idle.items()])
        met = "met" if idle["per worker %"] <= IDLE_TARGET else "NOT met"
        lines.append(f"idle per worker (its processes): target <= {IDLE_TARGET:g}%: {met}")
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4], metavar="N")
    p.add_argument("--cells", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--floor-reps", type=int, default=2000)
    p.add_argument("--cpu-cells", type=int, default=5000, help="cells for CPU per cell (0: skip)")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of idle (0: skip)")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("\n".join(measure(args.one, args)))
        return
    lines = [
        "monarch-nb round trip, start-up and idle breakdown",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(PACKAGES)}",
        "",
    ]
    began = time.perf_counter()
    for n in args.workers:
        # each size in a fresh process: start-up imports nothing twice, and wraps nothing twice
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode:
            tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            lines += [f"== {n} workers: failed: {tail}", ""]
        else:
            lines += proc.stdout.splitlines()
    lines.append(
        f"load average after: {os.getloadavg()[0]:.2f}; total wall time: "
        f"{time.perf_counter() - began:.0f} s"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
