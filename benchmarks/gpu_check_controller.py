"""Parts 3a and 3b of benchmarks/gpu_check.py: the controller on the machine's GPU, driven from
a real IPython shell, and notebook 04 run by a real Jupyter kernel.

    python benchmarks/gpu_check_controller.py controller --result r.json [--cpu]
    python benchmarks/gpu_check_controller.py notebook --result r.json --out DIR [--cpu]

What the cells print goes to stdout (the driver's controller.log); the verdict goes to
``--result`` as {"headline", "problems", "not_here", "numbers"}: no problem, the part passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "04-distributed-training.ipynb"
GIB = 2**30
# The training cell: on a GPU the benchmark's headline case with 4 GiB of data on the device;
# in the dry-run small enough for a 2-core machine
TRAIN = {
    "gpu": {"width": 4096, "blocks": 64, "batch": 16384, "batches": 32, "dtype": "bfloat16"}
    | {"seconds": 20},
    "cpu": {"width": 256, "blocks": 4, "batch": 256, "batches": 256, "dtype": "float32"}
    | {"seconds": 4},
}
IDLE_SECONDS = 2  # the baseline: the rank's device idle, sampled as a cell runs
MEMORY_SLACK = GIB  # NVML may see this much beyond torch's reserved memory (CUDA modules, cuBLAS)
GONE_WAIT = 30  # s for the processes of a closed cluster to exit

IDLE = """%%monarch
import os, time, torch
_ = torch.zeros(1, device=device)  # the device's context exists before the baseline
cuda = device.type == "cuda"
t0 = time.time(); time.sleep({idle}); t1 = time.time()
{{"device": str(device), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
  "count": torch.cuda.device_count() if cuda else 0,
  "name": torch.cuda.get_device_name(device) if cuda else "cpu", "t0": t0, "t1": t1,
  "allocated": torch.cuda.memory_allocated(device) if cuda else 0,
  "reserved": torch.cuda.memory_reserved(device) if cuda else 0}}
"""

TRAIN_CELL = """%%monarch
import time, torch
from torch import nn
from monarch_kernels import MonarchLinear
from monarch_nb import log

torch.manual_seed(0)
data = torch.randn({batches}, {batch}, {width}, device=device, dtype=torch.{dtype})
model = nn.Sequential(
    MonarchLinear({width}, {width}, nblocks={blocks}), nn.GELU(),
    MonarchLinear({width}, {width}, nblocks={blocks}),
).to(device, torch.{dtype})
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

def memory():
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    held = data.nbytes + 4 * sum(p.nbytes for p in model.parameters())  # + grads, Adam's two
    return held, held

def step(i):
    x = data[i % len(data)]
    loss = nn.functional.mse_loss(model(x).float(), x.float())  # learn the identity
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return loss

first = [step(i).item() for i in range(3)][0]  # and the kernels' path choice and tuning
start, steps = time.time(), 0
while time.time() - start < {seconds}:
    loss = step(steps)
    steps += 1
    if steps % 50 == 0:
        allocated, reserved = memory()
        log(step=steps, loss=loss.item(), allocated=allocated, reserved=reserved)
last = loss.item()
{{"start": start, "end": time.time(), "steps": steps, "first": first, "last": last}}
"""


class CellFailed(Exception):
    pass


def _one_line(e: Exception) -> str:
    return str(e) if isinstance(e, CellFailed) else f"{type(e).__name__}: {e}"


def run_cell(shell, source: str):
    print(f"\n>>> {source.splitlines()[0]}  ({len(source.splitlines())} lines)", flush=True)
    result = shell.run_cell(source, store_history=True)
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise CellFailed(f"{source.splitlines()[0]!r} raised {type(error).__name__}: {error}")
    return result.result


def controller(cpu: bool) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    import monarch_nb
    from monarch_nb.controller.cluster import detect_gpus

    shell = InteractiveShell.instance()
    print(f"monarch_nb sees GPUs: {detect_gpus()}", flush=True)
    run_cell(shell, "%load_ext monarch_nb")
    run_cell(shell, "%monarch up --cpu --workers 1" if cpu else "%monarch up")
    try:
        verdict = _train_and_watch(shell, monarch_nb.current(), cpu)
    except Exception as e:  # a cell that failed, or a reading of ours: down all the same
        traceback.print_exc()
        verdict = {"headline": "stopped", "problems": [_one_line(e)], "numbers": {}}
    try:
        run_cell(shell, "%monarch down")
    except CellFailed as e:
        verdict["problems"].append(str(e))
    left = wait_gone()
    if left:
        verdict["problems"].append(f"%monarch down left {len(left)} process(es): {left}")
    verdict["headline"] += f"; down left {_processes(left)}"
    return verdict


def _train_and_watch(shell, ctl, cpu: bool) -> dict:
    """The idle cell, the training cell and what the rank's samples say of them."""
    import monarch_nb

    problems = []
    idle = run_cell(shell, IDLE.format(idle=IDLE_SECONDS)).item(0)
    want = ("cpu", None) if cpu else ("cuda:0", "0")
    if ctl.world_size != 1 or (idle["device"], idle["visible"] or None) != want:
        problems.append(
            f"{ctl.world_size} rank(s), rank 0 on {idle['device']} with CUDA_VISIBLE_DEVICES="
            f"{idle['visible']!r}; wanted one rank on {want[0]}"
        )
    train = run_cell(shell, TRAIN_CELL.format(**TRAIN["cpu" if cpu else "gpu"])).item(0)
    rows = monarch_nb.history().get(0, [])  # catches up on what the rank sent: samples too
    samples = ctl.metrics.samples(0)
    print_samples(samples, idle, train)
    telemetry, numbers = telemetry_verdict(samples, rows, idle, train, cpu)
    problems += numbers.pop("problems")
    if not train["last"] < train["first"]:
        problems.append(f"the loss did not fall: {train['first']:.4g} -> {train['last']:.4g}")
    where = idle["device"] if cpu else f"{idle['device']} ({idle['name']})"
    where += "" if cpu else f", CUDA_VISIBLE_DEVICES={idle['visible']}"
    seconds = train["end"] - train["start"]
    headline = (
        f"{ctl.world_size} rank(s), rank 0 on {where}; {train['steps']} steps in "
        f"{seconds:.0f} s, loss {train['first']:.3g} -> {train['last']:.3g}; {telemetry}"
    )
    not_here = (
        "a CPU worker; psutil's worker CPU % and RSS in place of NVML's utilization and memory; "
        f"{TRAIN['cpu']['seconds']} s at width {TRAIN['cpu']['width']} in place of "
        f"{TRAIN['gpu']['seconds']} s at {TRAIN['gpu']['width']}"
        if cpu
        else ""
    )
    numbers |= {"steps": train["steps"], "loss": [train["first"], train["last"]]}
    return {"headline": headline, "problems": problems, "not_here": not_here, "numbers": numbers}


def _processes(left: list) -> str:
    return f"{len(left) or 'no'} process{'es' if len(left) > 1 else ''}"


def telemetry_verdict(samples, rows, idle, train, cpu: bool) -> tuple[str, dict]:
    """The rank's samples (NVML's, or psutil's in the dry-run) while it idled and while it
    trained, against what torch said it held: a line, and the numbers with any problems."""
    base = [s for s in samples if idle["t0"] <= s["time"] <= idle["t1"]]
    loop = [s for s in samples if train["start"] <= s["time"] <= train["end"]]
    util, mem = ("cpu", "rss") if cpu else ("util", "mem_used")
    problems = []
    if not rows:
        return "no telemetry", {"problems": ["history() holds nothing rank 0 logged"]}
    if len(base) < 1 or len(loop) < 3:
        problems.append(f"{len(base)} samples while idle and {len(loop)} while training")
    ubase = [s[util] for s in base if s[util] is not None]
    uloop = [s[util] for s in loop if s[util] is not None]
    mbase = [s[mem] for s in base if s[mem] is not None]
    mloop = [s[mem] for s in loop if s[mem] is not None]
    if not (ubase and uloop and mbase and mloop):
        problems.append(f"the samples lack {util} or {mem}: {samples[-1:]}")
        return "no telemetry", {"problems": problems}
    u0, u1 = max(ubase), statistics.median(uloop)
    # rising: by 20 points (of one core for psutil), and on a GPU busy half the time at least
    if u1 < u0 + 20 or (not cpu and u1 < 50):
        problems.append(f"{util} did not rise while training: {u0:.0f}% idle, {u1:.0f}% median")
    rise = max(mloop) - statistics.median(mbase)
    allocated = max(r.values["allocated"] for r in rows) - idle["allocated"]
    reserved = max(r.values["reserved"] for r in rows) - idle["reserved"]
    # NVML sees at least what torch allocated, and not much beyond what its allocator reserved
    if rise < 0.9 * allocated or (not cpu and rise > reserved + MEMORY_SLACK):
        problems.append(
            f"{mem} rose {rise / GIB:.2f} GiB while torch held {allocated / GIB:.2f} GiB "
            f"(reserved {reserved / GIB:.2f} GiB)"
        )
    source = "psutil" if cpu else "NVML"
    torch_side = "held" if cpu else "allocated"
    line = (
        f"{source} {util} {u0:.0f}% idle -> {u1:.0f}% training, {mem} +{rise / GIB:.2f} GiB "
        f"against torch's {torch_side} +{allocated / GIB:.2f} GiB (reserved +{reserved / GIB:.2f})"
    )
    numbers = {"util": [u0, u1], "mem_rise": rise, "allocated": allocated, "reserved": reserved}
    return line, {**numbers, "problems": problems}


def print_samples(samples, idle, train) -> None:
    """The rank's samples around the training cell, for the log."""
    print("\nsamples of rank 0 (s from the idle cell's start):", flush=True)
    print("    s  util%   cpu%  mem_used GiB  rss GiB  phase")
    for s in samples:
        if s["time"] < idle["t0"] - 1:
            continue
        phase = "training" if train["start"] <= s["time"] <= train["end"] else ""
        phase = phase or ("idle" if idle["t0"] <= s["time"] <= idle["t1"] else "")
        print(
            f"{s['time'] - idle['t0']:5.1f}  {_num(s['util'], 5)}  {_num(s['cpu'], 5)}  "
            f"{_num(s['mem_used'] and s['mem_used'] / GIB, 12, '.2f')}  "
            f"{_num(s['rss'] and s['rss'] / GIB, 7, '.2f')}  {phase}"
        )


def _num(v, width: int, fmt: str = ".0f") -> str:
    return f"{v:{width}{fmt}}" if v is not None else "-".rjust(width)


def wait_gone() -> list[str]:
    """This process's descendants still running after GONE_WAIT s (multiprocessing's resource
    tracker aside: it belongs to this interpreter and ends with it)."""
    import psutil

    deadline = time.monotonic() + GONE_WAIT
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())
                if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmd:
                    left.append(f"{p.pid} {cmd[:80]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def notebook(cpu: bool, out: Path, limit: float) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOK, as_version=4)
    where = {"metadata": {"path": str(NOTEBOOK.parent)}}
    client = NotebookClient(nb, timeout=limit, kernel_name="python3", resources=where)
    problems = []
    try:
        client.execute()
    except CellExecutionError as e:
        problems.append(str(e).strip().splitlines()[-1][:300])
    finally:
        nbformat.write(nb, out / "notebook-04.ipynb")
    cells = [(c.source.splitlines()[0], text_of(c), c) for c in nb.cells if c.cell_type == "code"]
    for first, text, cell in cells:
        if any(o["output_type"] == "error" for o in cell.get("outputs", [])) and not problems:
            problems.append(f"{first!r} failed: {text.strip().splitlines()[-1][:200]}")
    texts = {first: text for first, text, _ in cells}
    everything = "".join(texts.values())
    up = texts.get("%load_ext monarch_nb", "")
    devices = re.findall(r"^\d+\s+\S+\s+\d+\s+(.+)$", up, re.M)
    want = "cpu:" if cpu else "cuda:"
    if not devices or not all(d.startswith(want) for d in devices):
        problems.append(f"%monarch up put the ranks on {devices or 'nothing'}, not {want}")
    group = re.findall(r"torch.distributed: (\S+) process group", up)
    pulled = re.findall(
        r"rank 0: monarch \d+ params ([\d.]+) ms/step acc ([\d.]+) \| dense \d+ params "
        r"([\d.]+) ms/step acc ([\d.]+)",
        everything,
    )
    speed = re.findall(r'"steps_per_s": ([\d.]+)', everything)
    if "cluster shut down" not in texts.get("%monarch down", ""):
        problems.append("%monarch down did not say 'cluster shut down'")
    left = wait_gone()
    if left:
        problems.append(f"the notebook left {len(left)} process(es): {left}")
    headline = f"{len(devices)} rank(s) on {devices[0] if devices else '?'}"
    headline += f", {group[0] if group else 'no'} process group"
    if pulled:
        m_ms, m_acc, d_ms, d_acc = pulled[0]
        headline += f"; monarch {m_ms} ms/step acc {m_acc}, dense {d_ms} ms/step acc {d_acc}"
    if speed:
        headline += f"; %monarch run {float(speed[0]):.0f} steps/s"
    headline += f"; down left {_processes(left)}"
    not_here = "CPU ranks and gloo in place of the GPU and NCCL" if cpu else ""
    return {"headline": headline, "problems": problems, "not_here": not_here, "numbers": {}}


def text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
    return "".join(parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["controller", "notebook"])
    p.add_argument("--result", required=True, type=Path)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--limit", type=float, default=120, help="seconds a notebook cell may take")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    try:
        if args.what == "controller":
            verdict = controller(args.cpu)
        else:
            verdict = notebook(args.cpu, args.out, args.limit)
    except Exception as e:  # the verdict says what stopped it; the log has the traceback
        traceback.print_exc()
        verdict = {"headline": "stopped", "problems": [_one_line(e)], "numbers": {}}
    args.result.write_text(json.dumps(verdict))
    print(f"\n{args.what}: {verdict['headline']}; problems: {verdict['problems'] or 'none'}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
