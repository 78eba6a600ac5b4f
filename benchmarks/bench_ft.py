"""Fault-tolerant training (torchft, ``up(ft=True)``) on 4 CPU ranks over gloo, in one run.

    python benchmarks/bench_ft.py [--soak 300] [--quick] [--seed 0]

1. Steps/s of FT-DDP (``ft.wrap``, ``ft.steps``) against plain DDP over the cluster's gloo group,
   the same model, taking turns (target >= 0.9x), with where a step's time goes on rank 0 and
   the CPU a step costs the machine (the 4 ranks' processes, every thread, and the
   Lighthouse's); beside them torchft's quorum alone, each step, with no model (diagnostic).
2. Steps lost per SIGKILL (target 0): 3 kills (seeded victims, each once the last is back)
   against the same run without. Batches are seeded by (step, rank); the final loss is each
   rank's on a held-out batch after the loop, mean over ranks (target within 2%).
3. The kill to the survivors' next committed step (<= 2 s: the first ``ctl.ft_steps`` report
   with fewer participants) and to the replacement's first (<= 10 s: its "back" event).
4. A soak: a kill every 5 s (any rank with a worker, replacements too) for ``--soak`` s, cell
   after cell: all ranks end at the step, each step committed once, steps yielded strictly
   increasing, no hang (a cell timeout, and a watchdog), no process left after ``down()``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import random
import statistics
import sys
import threading
import time

import machine
import psutil

import monarch_nb

WORLD = 4
EVENTS = ("lost", "joining", "healing", "back")
NAMES = {
    "ddp": "plain DDP",
    "ft": "FT-DDP",
    "ftq": "FT-DDP, its quorum awaited first (diagnostic)",
    "q": "torchft's quorum alone, no model (diagnostic)",
}
SETUP = """
import collections, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_nb import ft
torch.set_num_threads(1)
DIM, BATCH = 128, 64
_g = torch.Generator().manual_seed(12345)
TEACHER = torch.randn(DIM, 16, generator=_g) / DIM**0.5, torch.randn(16, 1, generator=_g) / 4

def fresh(hid):
    torch.manual_seed(0)
    L = torch.nn.Linear
    m = torch.nn.Sequential(L(DIM, hid), torch.nn.Tanh(), L(hid, hid), torch.nn.Tanh(), L(hid, 1))
    return m, torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)

def batch(step, seed=None):  # the same batch for (step, rank), whoever runs it and how often
    g = torch.Generator().manual_seed(1_000_003 * step + rank if seed is None else seed)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, torch.tanh(x @ TEACHER[0]) @ TEACHER[1]

HELD = batch(0, seed=987654321)
loss_fn = lambda m, xy: torch.nn.functional.mse_loss(m(xy[0]), xy[1])
held_loss = torch.no_grad()(lambda m: float(loss_fn(m, HELD)))

def ddp_run(steps, warm, hid):
    model, opt = fresh(hid)
    net, t = DDP(model), collections.Counter()
    for step in range(steps):
        a = time.perf_counter()
        if step == warm:
            t.clear(); start, cpu = a, time.process_time()
        opt.zero_grad(); loss_fn(net, batch(step)).backward()
        b = time.perf_counter()
        opt.step()
        t["fwd+bwd"] += b - a; t["opt.step"] += time.perf_counter() - b
    n, rate = steps - warm, (steps - warm) / (time.perf_counter() - start)
    cpu = 1e3 * (time.process_time() - cpu) / n  # this rank's process: all its threads
    ms = {k: 1e3 * v / n for k, v in t.items()}
    return dict(rate=rate, ms=ms, loss=held_loss(model), cpu=cpu)

def ft_run(steps, warm, hid, sync=False):
    model, opt = ft.wrap(*fresh(hid))
    mgr, it = ft.manager(), iter(ft.steps(steps))
    yielded, committed, slow, t, start = [], [], [], collections.Counter(), None
    while True:
        a = time.perf_counter()
        step = next(it, None)
        if step is None:
            break
        b = time.perf_counter()
        if start is None and step >= warm:
            t.clear(); start, first, cpu = a, step, time.process_time()
        yielded.append(step)
        if sync:  # the step's quorum waited for here, not in the first allreduce (diagnostic)
            mgr.wait_quorum()
            t["quorum"] += time.perf_counter() - b
        c = time.perf_counter()
        opt.zero_grad(); loss_fn(model, batch(step)).backward()
        d = time.perf_counter()
        opt.step()
        if mgr.current_step() > step:
            committed.append(step)
        e = time.perf_counter()
        t["ft.steps"] += b - a; t["fwd+bwd"] += d - c; t["opt.step"] += e - d
        if e - a > 0.25:  # where a slow step's time went, on the wall clock
            ok = committed[-1:] == [step]
            slow.append((time.time() - (e - a), step, b - a, c - b, d - c, e - d, ok))
    end, n = time.perf_counter(), len([s for s in yielded if s >= warm])
    cpu = 1e3 * (time.process_time() - cpu) / n if n else None
    pairs = list(zip(yielded, yielded[1:]))
    return dict(
        final=mgr.current_step(), loss=held_loss(model.module), first=yielded[:1],
        rate=(mgr.current_step() - first) / (end - start) if start else None,
        ms={k: 1e3 * v / n for k, v in t.items()} if n else {}, yields=len(yielded),
        repeats=sum(q == p for p, q in pairs), backwards=sum(q < p for p, q in pairs),
        slow=slow, once=bool(committed) and committed == list(range(committed[0], steps)), cpu=cpu,
    )
ftq_run = lambda steps, warm, hid: ft_run(steps, warm, hid, sync=True)

def q_run(steps, warm, hid):  # each step's quorum, started and awaited, and nothing else
    ft.wrap(*fresh(hid))
    mgr = ft.manager()
    for step in range(steps):
        if step == warm:
            start, cpu = time.perf_counter(), time.process_time()
        mgr.start_quorum(); mgr.wait_quorum()
    n, wall = steps - warm, time.perf_counter() - start
    return dict(rate=n / wall, ms={}, cpu=1e3 * (time.process_time() - cpu) / n)
"""


def children(but=()) -> dict[int, str]:
    """This process's descendants that are not zombies, ``but`` those: pid -> command line."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != "zombie" and p.pid not in but:
                out[p.pid] = " ".join(p.cmdline())[:100]
    return out


def table(head: str) -> None:
    print(f"| {head} |\n" + "|---" * (head.count("|") + 1) + "|")


def stat(values: list[float]) -> tuple[str, str]:
    return (f"{statistics.median(values):.2f}", f"{max(values):.2f}") if values else ("-", "-")


class Killer(threading.Thread):
    """SIGKILLs seeded victims while a cell trains (once its ranks report steps): at the planned
    steps, each once the victim before is back; or every ``every`` seconds, any rank with a
    worker, up to ``last_step`` (the replacement needs steps to come back in) and ``until``."""

    def __init__(self, ctl, rng, at_steps=(), every=None):
        super().__init__(daemon=True)
        self.ctl, self.rng, self.at_steps, self.every = ctl, rng, at_steps, every
        self.kills: list[tuple[float, int]] = []  # (time, victim)
        self.missed: list[str] = []
        self.done, self.since, self.last_step, self.until = threading.Event(), time.time(), 0, 0.0

    def progress(self) -> int:
        steps = self.ctl.ft_steps
        return steps[-1][1] if steps and steps[-1][0] >= self.since else -1

    def back(self) -> bool:
        t, victim = self.kills[-1] if self.kills else (0, None)
        back = [e for e in list(self.ctl.ft_events) if e["rank"] == victim and e["time"] > t]
        return not self.kills or any(e["event"] == "back" for e in back)

    def kill(self) -> None:
        victim = self.rng.choice([r for r in range(WORLD) if self.ctl.ranks[r].alive])
        when = time.time()
        try:
            self.ctl.kill(victim)
            self.kills.append((when, victim))
        except Exception as e:  # its worker went between the choice and the kill
            self.missed.append(f"{victim}: {e}")

    def run(self) -> None:
        for at in self.at_steps:
            deadline = time.monotonic() + 60
            while self.progress() < at or (not self.back() and time.monotonic() < deadline):
                if self.done.wait(0.02):
                    return
            self.kill()
        while self.every and not self.done.wait(self.every):
            if 0 <= self.progress() <= self.last_step and time.time() < self.until:
                self.kill()


def run_cell(ctl, code: str, timeout: float):
    """(the cell's ValueMesh or None, the error, seconds). A watchdog dumps the stacks and
    ends this process if the cell outlives its timeout by a minute (a hang in the notebook)."""
    start = time.monotonic()
    faulthandler.dump_traceback_later(timeout + 60, exit=True)
    try:
        return ctl.run(code, quiet=True, timeout=timeout), None, time.monotonic() - start
    except Exception as e:
        took = time.monotonic() - start
        errors = getattr(e, "errors", {})
        lines = [f"rank {r}: {x.ename}: {x.evalue[:300]}" for r, x in errors.items()]
        return None, f"{type(e).__name__} after {took:.0f} s: " + ("; ".join(lines) or str(e)), took
    finally:
        faulthandler.cancel_dump_traceback_later()


def recovery(ctl, kills, since: float) -> dict[str, list[float]]:
    """Per kill, seconds to the survivors' next committed step (the first report with fewer
    participants than at the kill), and to the victim's events before it is killed again."""
    steps = [s for s in list(ctl.ft_steps) if s[0] >= since]
    events = [e for e in list(ctl.ft_events) if e["time"] >= since]
    out: dict[str, list[float]] = {k: [] for k in ("survivors", *EVENTS)}
    for k, (t, victim) in enumerate(kills):
        before = [p for (when, _, p) in steps if when <= t] or [0]
        out["survivors"] += [w - t for (w, _, p) in steps if w > t and p < before[-1]][:1]
        stop = min([kt for kt, v in kills[k + 1 :] if v == victim] or [float("inf")])
        mine = [e for e in events if e["rank"] == victim and t < e["time"] < stop]
        for name in EVENTS:
            out[name] += [e["time"] - t for e in mine if e["event"] == name][:1]
    return out


def timeline(result, kills) -> None:
    """Each rank's steps over 0.25 s from each kill to the next, by part of the loop."""
    print(
        "\nsteps over 0.25 s from each kill (at: ft.steps/quorum/fwd+bwd/opt.step s; X: retried)\n"
    )
    for k, (t, victim) in enumerate(kills):
        end = kills[k + 1][0] if k + 1 < len(kills) else t + 30
        line = []
        for r, v in result.items():
            for when, step, *parts, ok in [x for x in v["slow"] if t - 0.5 < x[0] < end]:
                split = "/".join(f"{p:.2f}" for p in parts)
                line.append(f"rank {r} step {step} at {when - t:+.2f}: {split}{'' if ok else ' X'}")
        print(f"- kill of rank {victim}: " + ("; ".join(line) or "none"))


def per_rank_table(result, steps: int) -> None:
    table(
        "rank | final step | first step yielded | yields | repeated yields | backwards | "
        "each step committed once | held-out loss"
    )
    for r, v in result.items():
        first, once = (v["first"] or ["-"])[0], "yes" if v["once"] else "NO"
        print(
            f"| {r} | {v['final']} / {steps} | {first} | {v['yields']} | {v['repeats']} | "
            f"{v['backwards']} | {once} | {v['loss']:.5f} |"
        )


def throughput(ctl, hid: int, steps: int, warm: int, repeats: int, kinds=("ddp", "ft")) -> float:
    lighthouse = psutil.Process(ctl.ft.pid)
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpus: dict[str, list[float]] = {kind: [] for kind in kinds}
    ms: dict[str, dict] = {}
    for _ in range(repeats):  # taking turns: the machine's load changes
        for kind in kinds:
            before = sum(lighthouse.cpu_times()[:2])
            res = ctl.run(f"{kind}_run({steps}, {warm}, {hid})", quiet=True)
            beside = 1e3 * (sum(lighthouse.cpu_times()[:2]) - before) / steps
            rates[kind].append(min(v["rate"] for v in res.values()))
            cpus[kind].append(sum(v["cpu"] for v in res.values()) + beside)
            ms[kind] = res.item(0)["ms"]
    rate = {kind: statistics.median(r) for kind, r in rates.items()}
    for kind in kinds:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ms[kind].items())
        ratio = rate[kind] / rate["ddp"]
        ratio = f"{ratio:.2f}x | {'met' if ratio >= 0.9 else 'NOT met'}" if kind == "ft" else " |"
        print(
            f"| {hid} | {NAMES[kind]} | {rate[kind]:.1f} | {1e3 / rate[kind]:.2f} | "
            f"{statistics.median(cpus[kind]):.2f} | {parts} | {ratio} |"
        )
    return rate["ft"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--soak", type=float, default=None, help="seconds (default 300; 0 skips)")
    p.add_argument("--quick", action="store_true", help="everything smaller: about 90 s")
    p.add_argument("--seed", type=int, default=0, help="seeds the victims")
    args = p.parse_args()
    soak = args.soak if args.soak is not None else (20 if args.quick else 300)
    print(f"# {machine.cpu()}\n# {machine.versions(('torch', 'torchft', 'distributed'))}")
    print(f"# {WORLD} CPU ranks, gloo, 1 thread each; MLP 128-H-H-1, batch 64; seed {args.seed}")
    before, started = children(), time.monotonic()
    ctl = monarch_nb.up(workers=WORLD, cpu=True, ft=True)
    print(f"# up with the Lighthouse: {time.monotonic() - started:.1f} s\n")
    try:
        ctl.run(SETUP, setup=True, quiet=True)
        ctl.run("ddp_run(20, 0, 256), ft_run(20, 0, 256)", quiet=True)  # warm-up
        repeats = 1 if args.quick else 3
        print("## 1. Steps/s, FT-DDP against plain DDP (the same model, taking turns)\n")
        print(
            f"median of {repeats}; ms per step on rank 0, by part of the loop (fwd+bwd: with the "
            "allreduces, in which FT-DDP waits for the step's quorum unless awaited first; "
            "opt.step: torchft's should_commit and the step)\n"
        )
        table(
            "hidden | loop | steps/s | ms/step | CPU ms/step, 4 ranks + Lighthouse | "
            "ms in each part | FT/DDP | >= 0.9x"
        )
        kinds = ("ddp", "ft") if args.quick else tuple(NAMES)
        rate = throughput(ctl, 256, 400 if args.quick else 1000, 50, repeats, kinds)
        if not args.quick:
            throughput(ctl, 1024, 150, 20, 2)
        steps = max(200, int(rate * (12 if args.quick else 40)))
        train(ctl, steps, 1 if args.quick else 3, random.Random(args.seed))
        if soak > 0:
            soak_test(ctl, rate, soak, random.Random(args.seed + 1))
    finally:
        ctl.down()
    left = children(but=before)
    print(
        f"\n## 5. Processes after down()\n\nchildren of this process before up(): "
        f"{len(before)}; new ones left when down() returned: {len(left)}"
    )
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = children(but=before)
    for pid, cmd in left.items():
        print(f"- still there 10 s later: {pid} {cmd}")
    sys.stdout.flush()
    os._exit(0)  # not waiting for the threads of a cell that hung


def train(ctl, steps: int, kills: int, rng: random.Random) -> None:
    print(f"\n## 2. Steps lost per SIGKILL: {steps} steps, without and with {kills} kills\n")
    ref, err, ref_s = run_cell(ctl, f"ft_run({steps}, 0, 256)", 600)
    if ref is None:
        print(f"the run without kills failed: {err}")
        return
    plan = [steps * (k + 1) // (kills + 2) for k in range(kills)]
    killer = Killer(ctl, rng, at_steps=plan)
    killer.start()
    res, err, kill_s = run_cell(ctl, f"ft_run({steps}, 0, 256)", 600)
    killer.done.set()
    print(f"\nkills planned at steps {plan}; made: {[f'rank {v}' for _, v in killer.kills]}\n")
    if res is None:
        print(f"the run with kills failed: {err}")
        return
    lr, lk = (statistics.mean(v["loss"] for v in r.values()) for r in (ref, res))
    fr, fk = (min(v["final"] for v in r.values()) for r in (ref, res))
    lost = (fr - fk) / max(1, len(killer.kills))
    retried = sum(v["repeats"] for v in res.values()) / max(1, len(killer.kills))
    rel = abs(lk - lr) / lr
    table("run | s | final step (all ranks) | final loss (mean of ranks) | spread")
    for name, r, t, mean in (("no kills", ref, ref_s, lr), ("kills", res, kill_s, lk)):
        losses, finals = [v["loss"] for v in r.values()], sorted({v["final"] for v in r.values()})
        print(f"| {name} | {t:.1f} | {finals} | {mean:.5f} | {max(losses) - min(losses):.1e} |")
    print(
        f"\nsteps lost per kill: {lost:g} (target 0: {'met' if lost == 0 else 'NOT met'}); "
        f"loss difference {100 * rel:.2f}% (<= 2%: {'met' if rel <= 0.02 else 'NOT met'}); "
        f"step attempts that did not commit and were yielded again: {retried:.1f} per kill\n"
    )
    for name, r in (("without kills", ref), ("with kills", res)):
        print(f"{name}:\n")
        per_rank_table(r, steps)
        print()
    timeline(res, killer.kills)
    times = recovery(ctl, killer.kills, killer.since)
    print("\n## 3. From the kill to ... (s, over the kills)\n")
    table("to | n | median | max | target")
    for label, key, target in (
        ("the survivors' next committed step", "survivors", 2.0),
        ("the notebook noticing the loss (lost)", "lost", None),
        ("a replacement worker attached (joining)", "joining", None),
        ("its first quorum, state received (healing)", "healing", None),
        ("the first committed step it takes part in (back)", "back", 10.0),
    ):
        med, worst = stat(times[key])
        ok = len(times[key]) == len(killer.kills) and worst != "-" and float(worst) <= (target or 0)
        verdict = f"<= {target:g} s: {'met' if ok else 'NOT met'}" if target else ""
        print(f"| {label} | {len(times[key])} | {med} | {worst} | {verdict} |")


def soak_test(ctl, rate: float, seconds: float, rng: random.Random) -> None:
    print(f"\n## 4. Soak: a kill every 5 s for {seconds:g} s, cell after cell\n")
    killer = Killer(ctl, rng, every=5.0)
    t0, rows, all_kills = time.time(), [], []
    end = killer.until = t0 + seconds
    killer.start()
    while time.time() < end - 10:
        wait = time.monotonic() + 90
        while not all(i.alive for i in ctl.ranks) and time.monotonic() < wait:
            time.sleep(0.2)
        steps = max(200, int(rate * (end - time.time())))
        killer.kills, killer.last_step, killer.since = [], steps - int(15 * rate), time.time()
        res, err, took = run_cell(ctl, f"ft_run({steps}, 0, 256)", 3 * (end - time.time()) + 120)
        killer.since = float("inf")  # no kills between cells
        all_kills += (kills := killer.kills)
        times = recovery(ctl, kills, time.time() - took - 1)
        if res is None:
            rows.append((steps, took, kills, "**failed**: " + err, times))
            continue
        vs = res.values()
        yn = {True: "yes", False: "NO"}
        verdict = (
            f"returned; all end at the step: {yn[all(v['final'] == steps for v in vs)]}; each "
            f"step committed once on {sum(v['once'] for v in vs)} of {WORLD} ranks; yields "
            f"repeated {sum(v['repeats'] for v in vs)}, backwards {sum(v['backwards'] for v in vs)}"
        )
        rows.append((steps, took, kills, verdict, times))
    killer.done.set()
    table(
        "cell | steps | s | kills (victims) | survivors' next step s (median / max) | "
        "victim back s (median / max, n) | outcome"
    )
    for i, (steps, took, kills, outcome, times) in enumerate(rows):
        s, b = stat(times["survivors"]), stat(times["back"])
        print(
            f"| {i + 1} | {steps} | {took:.0f} | {len(kills)} {[v for _, v in kills]} | "
            f"{s[0]} / {s[1]} | {b[0]} / {b[1]}, {len(times['back'])} | {outcome} |"
        )
    print(
        f"\n{len(all_kills)} kills in {time.time() - t0:.0f} s; kills that found no worker: "
        f"{len(killer.missed)}; cells that returned: {sum('returned' in r[3] for r in rows)} "
        f"of {len(rows)}; no hang: yes (no cell outlived its timeout)"
    )


if __name__ == "__main__":
    main()
