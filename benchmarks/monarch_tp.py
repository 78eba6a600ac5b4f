"""Monarch tensor parallelism against dense: the bytes each layer sends per training step, and
the step's time, at 2 and 4 CPU ranks (gloo).

Every model is two layers of width w with a GELU between, on every rank of a 1-d mesh:

* dense: ``nn.Linear`` pair, ``ColwiseParallel`` then ``RowwiseParallel`` (torch's
  ``parallelize_module``), input and output replicated: one all-reduce each way;
* monarch drop-in: ``shard_monarch`` of a ``MonarchLinear`` pair, each layer replicated in and
  out: per layer an all-to-all each way, an all-gather of the output and of the input's gradient;
* monarch sharded between: as Megatron's MLP, input and output replicated, the activation
  between sharded (first layer ``output_layout="sharded"``, second ``input_layout="sharded"``);
* monarch in a sharded stack: both layers sharded in and out, as deep in a stack whose
  activations stay sharded (the input is sharded too): two all-to-alls per layer each way.

A step is a forward and a backward (loss: the output's sum; the input needs a gradient, as a
layer inside a model would). "counted" is :func:`monarch_kernels.monarch_tp_bytes` /
:func:`~monarch_kernels.dense_tp_bytes` per layer (the pair's / 2) for the rank sending most;
"sent" is what that rank's process wrote during the step (``/proc/self/io``, gloo's TCP
transport: the counted bytes plus a 144-byte header per message). Step time: the slowest
rank's, median of the timed steps; the models take turns step by step.

    PYTHONPATH=kernels python benchmarks/monarch_tp.py [--worlds 2 4] [--width 1024]
        [--blocks 4] [--batch 512] [--steps 10]

``run(...)`` returns the rows and ``table(rows)`` formats them, for other benchmarks to call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import machine
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from monarch_kernels import (
    CommBytes,
    MonarchLinear,
    ShardedMonarchLinear,
    dense_tp_bytes,
    monarch_tp_bytes,
    shard_monarch,
)
from monarch_kernels.tp_bytes import written_bytes
from torch import nn

MODELS = ("dense", "monarch drop-in", "monarch sharded between", "monarch in a sharded stack")


def _models(mesh, width: int, blocks: int) -> dict[str, nn.Module]:
    """Each model of the module docstring, this rank's share, built from one seed."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    parallelize_module(dense, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    pair = [MonarchLinear(width, width, nblocks=blocks) for _ in range(2)]

    def sharded(i: int, inl: str, outl: str) -> ShardedMonarchLinear:
        return ShardedMonarchLinear.from_linear(pair[i], mesh, input_layout=inl, output_layout=outl)

    return {
        "dense": dense,
        "monarch drop-in": shard_monarch(nn.Sequential(pair[0], nn.GELU(), pair[1]), mesh),
        "monarch sharded between": nn.Sequential(
            sharded(0, "replicated", "sharded"), nn.GELU(), sharded(1, "sharded", "replicated")
        ),
        "monarch in a sharded stack": nn.Sequential(
            sharded(0, "sharded", "sharded"), nn.GELU(), sharded(1, "sharded", "sharded")
        ),
    }


def _counted(model: nn.Module, name: str, width: int, batch: int, world: int) -> CommBytes:
    if name == "dense":
        return dense_tp_bytes(width, width, batch, world)
    first, second = model[0], model[2]
    return monarch_tp_bytes(first, batch) + monarch_tp_bytes(second, batch)


def _kinds(counted: CommBytes) -> str:
    """``2 all-to-all, 2 all-gather``: the collectives of one step."""
    names = [what.split(",")[0] for what, _ in counted.forward + counted.backward]
    return ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names))


def _rank(rank: int, world: int, init: str, opts: dict, out: str) -> None:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    width, batch = opts["width"], opts["batch"]
    models = _models(mesh, width, opts["blocks"])
    inputs, times, sent = {}, {name: [] for name in models}, {name: [] for name in models}
    for name in models:
        torch.manual_seed(1)
        x = torch.randn(batch, width)
        if name == "monarch in a sharded stack":
            x = x.chunk(world, -1)[rank]
        inputs[name] = x.requires_grad_()
    # the models take turns, step by step, so that the machine's load falls on all alike
    for step in range(opts["warmup"] + opts["steps"]):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            inputs[name].grad = None
            dist.barrier()
            before, t0 = written_bytes(), time.perf_counter()
            model(inputs[name]).sum().backward()
            elapsed, wrote = time.perf_counter() - t0, written_bytes() - before
            if step >= opts["warmup"]:
                times[name].append(elapsed)
                sent[name].append(wrote)
    rows = []
    for name, model in models.items():
        counted = _counted(model, name, width, batch, world)
        every = [None] * world
        dist.all_gather_object(
            every, (times[name], statistics.median(sent[name]), counted.step_bytes)
        )
        slowest = [max(ts) for ts in zip(*(t for t, _, _ in every), strict=True)]
        busiest = max(range(world), key=lambda r: every[r][2])
        rows.append(
            {
                "ranks": world,
                "model": name,
                "collectives": _kinds(counted),
                "counted": counted.step_bytes / 2,
                "sent": every[busiest][1] / 2,
                "ms": 1e3 * statistics.median(slowest),
            }
        )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run(worlds=(2, 4), width=1024, blocks=4, batch=512, steps=10, warmup=2) -> list[dict]:
    """One row per rank count and model: the bytes per layer per step (counted and sent by the
    busiest rank) and the median step time in ms."""
    opts = {"width": width, "blocks": blocks, "batch": batch, "steps": steps, "warmup": warmup}
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(_rank, args=(world, f"file://{tmp}/store", opts, out), nprocs=world)
            with open(out) as f:
                rows += json.load(f)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; ratios against the dense model at the same rank count."""
    dense = {r["ranks"]: r for r in rows if r["model"] == "dense"}
    head = (
        "| ranks | model | collectives per step | counted B/layer/step | sent B/layer/step "
        "| bytes vs dense | step ms | time vs dense |"
    )
    lines = [head, "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = dense[r["ranks"]]
        lines.append(
            f"| {r['ranks']} | {r['model']} | {r['collectives']} | {r['counted']:,.0f} "
            f"| {r['sent']:,.0f} | {r['counted'] / ref['counted']:.2f}x | {r['ms']:.1f} "
            f"| {r['ms'] / ref['ms']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    opts = p.parse_args()
    load = os.getloadavg()[0]
    rows = run(opts.worlds, opts.width, opts.blocks, opts.batch, opts.steps, opts.warmup)
    print(f"# {machine.cpu()}; {machine.versions(('torch',))}")
    print(
        f"# gloo CPU ranks; width {opts.width}, {opts.blocks} blocks, batch {opts.batch}, "
        f"float32; median of {opts.steps} steps after {opts.warmup} warm-up; "
        f"load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
