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
    .venv/bin/python benchmarks/bench_telemetry.py --browser --no-cluster --no-training

``--browser`` runs the same training in a real JupyterLab in headless Chromium, where the live
panel is drawn in the page, and measures the tab's main thread (Chromium's ``TaskDuration``
through CDP ``Performance.getMetrics``, over wall time) while a 4-rank panel updates at 2 Hz
(budget: 10% busy).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from monarch_nb.telemetry import samplers as telemetry


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
    from monarch_nb.telemetry import recorder

    rec = engine.worker.extensions[recorder.EXTENSION]
    monitor = rec._monitor
    probe = probe_name(monitor) if monitor is not None else "-"
    return time.monotonic(), rec.sampler.cpu_seconds, rec.sampler.samples, rec.hz, probe


def on_workers(seconds: float) -> list[dict]:
    import monarch_nb
    from monarch_nb.telemetry import metrics

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
    from monarch_nb.notebook.widgets import LivePanel
    from monarch_nb.telemetry import metrics

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


# -- the panel in a browser ------------------------------------------------------------------
BROWSER_UP = "%load_ext monarch_nb\n%monarch up --workers 4 --cpu"
WATCH = """\
%%monarch
import math, time
from monarch_nb import log
for step in range({steps}):
    log(step=step, loss=math.exp(-step / 50) + 0.01 * rank)
    time.sleep(0.05)
"""


class _Notebook:
    """A notebook in a page of headless Chromium on our own `jupyter lab`, run cell by cell."""

    def __init__(self, browser, lab):
        import nbformat

        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nb, lab.root / "bench.ipynb")
        self.page = browser.new_page(viewport={"width": 1300, "height": 1000})
        self.page.goto(f"{lab.url}/lab/tree/bench.ipynb?token={lab.token}")
        self.page.wait_for_function(
            "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
            timeout=120_000,
        )

    def start(self, source: str) -> int:
        from _lab import append_cell  # tests/ is on sys.path once browser_rows runs

        return append_cell(self.page, source, run=True)

    def wait(self, index: int, timeout: float = 600) -> str:
        """The cell's output text once it finished."""
        cell = "window.jupyterapp.shell.currentWidget.content.widgets[i]"
        self.page.wait_for_function(
            f"(i) => {cell} && {cell}.model.executionCount !== null",
            arg=index,
            timeout=timeout * 1000,
            polling=200,
        )
        return self.page.evaluate(f"(i) => {cell}.outputArea.node.innerText", index)

    def run(self, source: str, timeout: float = 600) -> str:
        return self.wait(self.start(source), timeout)


def browser_rows(steps: int, repeats: int, seconds: float, training: bool = True) -> str:
    """The training step with the panel drawn in a page against without it; the page's main
    thread while a 4-rank panel updates at 2 Hz."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from _lab import Lab, chromium

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        # the sidebar at its default polling (the tests' Lab polls faster)
        sidebar = {"monarch-nb/plugin": {"refreshInterval": 2000, "maxInterval": 15000}}
        lab = Lab(Path(tmp), settings=sidebar, expose_app=True)
        try:
            lab.wait_ready()
            with chromium() as browser:
                nb = _Notebook(browser, lab)
                printed = nb.run(BROWSER_UP)
                if "4 ranks" not in printed:
                    raise RuntimeError(f"%monarch up failed in the page: {printed}")
                nb.run("%%monarch\n" + TRAIN)
                nb.run(f"%%monarch --no-panel\n_train({steps // 4}, False)")  # warm up
                times: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(repeats if training else 0):  # alternate: drift hits both
                    for mode in ("off", "on"):
                        on = mode == "on"
                        magic = f"%%monarch --out _ms{'' if on else ' --no-panel'}"
                        nb.run(
                            "from monarch_nb import current\n"
                            "from monarch_nb.telemetry import metrics\n"
                            f"metrics.install(current().client, hz={2 if on else 0})"
                        )
                        nb.run(f"{magic}\n_train({steps}, {on})")
                        printed = nb.run("print('MS', sum(_ms.values()) / len(_ms))")
                        times[mode].append(float(printed.split("MS", 1)[1].split()[0]))
                cdp = nb.page.context.new_cdp_session(nb.page)
                cdp.send("Performance.enable")
                idle = _busy(cdp, nb.page, seconds)
                panel, updates = _panel_busy(cdp, nb, seconds)
                nb.run("%monarch down")
        finally:
            lab.stop()
    if training:
        off, on = (statistics.median(times[m]) for m in ("off", "on"))
        overhead = 100 * (on - off) / off
        out += [
            f"in JupyterLab, headless Chromium; DDP step on 4 CPU ranks, median of {repeats} "
            f"runs of {steps}",
            f"{'panel drawn in the page':<34} {'ms/step':>8} {'ratio':>6}",
            f"{'off (no telemetry, log, panel)':<34} {off:>8.3f} {1:>6.3f}",
            f"{'on (2 Hz, log every step, panel)':<34} {on:>8.3f} {on / off:>6.3f}",
            f"overhead {overhead:+.1f}% (target <= 2%: {'met' if overhead <= 2 else 'NOT met'})",
            "",
        ]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    out.append(f"the page's main thread, {seconds:g} s each; load average {load}")
    out.append(
        f"{'page':<28} {'task ms':>8} {'task %':>7} {'CPU ms':>7} {'CPU %':>6} {'updates/s':>9}"
    )
    for name, (task, cpu, wall), rate in (
        ("idle notebook, cluster up", idle, 0.0),
        ("4-rank panel updating", panel, updates / panel[2]),
    ):
        out.append(
            f"{name:<28} {task * 1e3:>8.0f} {100 * task / wall:>7.2f} {cpu * 1e3:>7.0f} "
            f"{100 * cpu / wall:>6.2f} {rate:>9.2f}"
        )
    pct = 100 * panel[0] / panel[2]
    out.append(
        f"busy (task time) {pct:.2f}% with the panel "
        f"(target < 10%: {'met' if pct < 10 else 'NOT met'})"
    )
    return "\n".join(out)


def _busy(cdp, page, seconds: float) -> tuple[float, float, float]:
    """Over ``seconds``: the page's main thread's task time (wall time spent in tasks, which
    grows when other processes hold the CPU), its CPU time, and the wall seconds."""

    def now() -> tuple[float, float]:
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        return metrics["TaskDuration"], metrics["ThreadTime"]

    t0, (task0, cpu0) = time.monotonic(), now()
    page.wait_for_timeout(seconds * 1000)
    task1, cpu1 = now()
    return task1 - task0, cpu1 - cpu0, time.monotonic() - t0


def _panel_busy(cdp, nb: _Notebook, seconds: float) -> tuple[tuple[float, float, float], int]:
    """``_busy`` while a cell's 4 ranks log a loss every 50 ms under a live panel, and how
    many times the panel was redrawn meanwhile."""
    page = nb.page
    index = nb.start(WATCH.format(steps=int((seconds + 10) / 0.05)))
    cell = "window.jupyterapp.shell.currentWidget.content.widgets[i]"
    page.wait_for_function(  # the panel is up (after its first second)
        f"(i) => {cell}?.outputArea.node.querySelector('.jupyter-widgets .monarch-panel')",
        arg=index,
        timeout=60_000,
    )
    page.evaluate(  # count the redraws: each one replaces the panel's node
        f"""(i) => {{
          window.__redraws = 0;
          const root = {cell}.outputArea.node;
          const panel = (n) => n.classList && n.classList.contains('monarch-panel');
          new MutationObserver((records) => {{
            for (const r of records) window.__redraws += [...r.addedNodes].filter(panel).length;
          }})
            .observe(root.querySelector('.jupyter-widgets'), {{childList: true, subtree: true}});
        }}""",
        index,
    )
    measured = _busy(cdp, page, seconds)
    updates = page.evaluate("() => window.__redraws")
    nb.wait(index)
    return measured, updates


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
    parser.add_argument("--browser", action="store_true", help="also in JupyterLab + Chromium")
    parser.add_argument("--browser-seconds", type=float, default=20.0, help="panel watched for")
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
    if args.browser:
        print()
        print(browser_rows(args.steps, args.repeats, args.browser_seconds, not args.no_training))


if __name__ == "__main__":
    main()
