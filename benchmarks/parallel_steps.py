"""One training step of each parallelism, the same code under ``torchrun`` and in a ``%%monarch``
cell (``bench_parallel.py`` runs both and compares their steps/s).

Strategies, on a device mesh over every rank:

- ``ddp``: ``DistributedDataParallel``, the batch split over the ranks;
- ``fsdp``: FSDP2 (``fully_shard``) per layer and on the whole model, the batch split;
- ``tp``: tensor parallel MLP pairs (column-wise up, row-wise down), the batch on every rank;
- ``2d``: FSDP over ``dp`` and tensor parallel over ``tp=2``;
- ``pp``: a GPipe pipeline, a stage per rank, 4 micro-batches.

Under torchrun, rank 0 prints ``RESULT {json}``::

    torchrun --nproc-per-node 2 benchmarks/parallel_steps.py fsdp --steps 20
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STRATEGIES = ("ddp", "fsdp", "tp", "2d", "pp")
WIDTH, PAIRS, BATCH = 256, 4, 64  # an MLP of PAIRS (up, down) pairs, 4x wide inside


def mesh_shape(strategy: str, world: int) -> dict[str, int]:
    """The mesh a strategy runs on: one dimension, or dp x tp=2 for 2d."""
    if strategy == "2d":
        return {"dp": world // 2, "tp": 2}
    return {{"tp": "tp", "pp": "pp"}.get(strategy, "dp"): world}


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Pair() for _ in range(PAIRS)))


def _tp(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(PAIRS):
        plan.update({f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _fsdp(model: nn.Sequential, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for pair in model:
        fully_shard(pair, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_step(strategy: str, mesh):
    """A function that runs one optimizer step of ``strategy`` on ``mesh`` (every rank calls it)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    if strategy == "pp":
        return _pipeline_step(mesh["pp"], x, y)
    model = _model()
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif strategy == "fsdp":
        model = _fsdp(model, mesh["dp"])
    elif strategy == "tp":
        model = _tp(model, mesh["tp"])
    else:
        model = _fsdp(_tp(model, mesh["tp"]), mesh["dp"])
    if strategy != "tp":  # data parallel: this rank's share of the batch
        dp = mesh["dp"]
        x, y = x.chunk(dp.size())[dp.get_local_rank()], y.chunk(dp.size())[dp.get_local_rank()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _pipeline_step(pp, x, y):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    i, n = pp.get_local_rank(), pp.size()
    model = _model()
    per = PAIRS // n  # the pairs of this stage (PAIRS is a multiple of 2 and of 4)
    part = model[i * per : (i + 1) * per]
    stage = PipelineStage(part, i, n, torch.device("cpu"), group=pp.get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        if i == 0:
            schedule.step(x)
        elif i == n - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()

    return step


def timed(strategy: str, mesh, steps: int, warmup: int = 3) -> float:
    """Steps per second of ``strategy`` over ``steps`` steps, from the first rank's clock
    between two barriers, after ``warmup`` steps."""
    step = make_step(strategy, mesh)
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy", choices=STRATEGIES)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    shape = mesh_shape(args.strategy, dist.get_world_size())
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    rate = timed(args.strategy, mesh, args.steps)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"strategy": args.strategy, "steps_per_s": rate}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
