"""What the first use of the Monarch kernels costs on a GPU, against the steady state.

Notebook 04's model (``MonarchLinear`` 64 -> 256 -> 256 in 4 blocks, then ``nn.Linear`` to 10
classes; batch 64, Adam) trained for 60 steps, then evaluated on 899 rows (a new batch size),
each variant in a process of its own with a Triton cache of its own:

    every config timed   the autotuner as it was before configs were pruned: every config of
                         every launch compiled and timed, nothing kept on disk
    pruned, cold         configs that only pad, and timing below ``configs.TINY``, left out;
                         an empty Triton cache
    pruned, warm         the same in a second process over the cache the first one filled (a
                         new worker, a restarted kernel)
    dense nn.Linear      the same model with dense layers

    python benchmarks/kernels_first_call.py [--steps 60] [--out FILE]

It needs a GPU: the Triton interpreter times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "every config timed": ("monarch", "unpruned", "cold"),
    "pruned, cold": ("monarch", "pruned", "cold"),
    "pruned, warm": ("monarch", "pruned", "warm"),
    "dense nn.Linear": ("dense", "pruned", "cold"),
}
CHILD_LIMIT = 180  # s: a variant that takes longer is reported as such


def child(kind: str, tuner: str, steps: int) -> dict:
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "kernels"))
    from monarch_kernels import MonarchLinear, triton_launch

    if tuner == "unpruned":  # the autotuner as triton_launch made it before the pruning
        import triton

        for k, fn in triton_launch._KERNELS.items():
            configs = triton_launch.get_configs(k)
            tune = triton.autotune(configs=configs, key=triton_launch._KEYS[k])
            triton_launch._autotuned[k] = tune(fn)
    device = torch.device("cuda")
    torch.manual_seed(0)

    def linear(i: int, o: int) -> nn.Module:
        return MonarchLinear(i, o, nblocks=4) if kind == "monarch" else nn.Linear(i, o)

    model = nn.Sequential(
        linear(64, 256), nn.GELU(), linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    x, y = torch.randn(899, 64, device=device), torch.randint(10, (899,), device=device)
    times = []
    for _ in range(steps):
        idx = torch.randint(len(x), (64,), device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    with torch.no_grad():
        model(x).argmax(1)
    torch.cuda.synchronize()
    evaluate = time.perf_counter() - start
    return {
        "first_s": times[0],
        "steady_ms": 1e3 * statistics.median(times[len(times) // 2 :]),
        "eval_s": evaluate,
        "total_s": sum(times) + evaluate,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", help="also write the table here")
    p.add_argument("--child", nargs=2, metavar=("KIND", "TUNER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "kernels_first_call: no GPU here; the Triton interpreter times nothing", file=sys.stderr
        )
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="first-call-") as tmp:
        caches = {"unpruned": Path(tmp, "unpruned"), "pruned": Path(tmp, "pruned")}
        for name, (kind, tuner, _state) in VARIANTS.items():
            cache = caches[tuner] if kind == "monarch" else Path(tmp, "dense")
            env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
            cmd = [sys.executable, __file__, "--child", kind, tuner, "--steps", str(args.steps)]
            start = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=CHILD_LIMIT
                )
            except subprocess.TimeoutExpired:
                rows.append((name, f"over {CHILD_LIMIT} s", "", "", ""))
                continue
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                rows.append(
                    (name, "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1], "", "", "")
                )
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(
                (
                    name,
                    f"{r['first_s']:.2f}",
                    f"{r['steady_ms']:.3f}",
                    f"{r['eval_s']:.2f}",
                    f"{r['total_s']:.1f} ({wall:.1f} with start-up)",
                )
            )
    head = ("variant", "first step s", "later steps ms", "first eval (899 rows) s", "all s")
    gpu = torch.cuda.get_device_name()
    lines = [
        f"notebook 04's model, batch 64, {args.steps} steps, on {gpu} "
        f"(torch {torch.__version__}, triton {_triton_version()})",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
