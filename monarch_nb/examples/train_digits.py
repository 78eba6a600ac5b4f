"""A torchrun-style data-parallel training script: an MLP with MonarchLinear (or dense) layers
on scikit-learn's digits (1,797 8x8 images that ship with the package).

It runs unmodified under ``torchrun -m monarch_nb.examples.train_digits``, ``%monarch run -m
monarch_nb.examples.train_digits`` (notebook 04) and, because it joins the process group only
when none exists, inside a ``%%monarch`` cell (``runpy.run_path(..., run_name="__main__")``).
Rank 0 prints one JSON line with the measured steps per second.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model(kind: str, hidden: int, nblocks: int) -> nn.Module:
    if kind == "monarch":
        from monarch_kernels import MonarchLinear

        def linear(i, o):
            return MonarchLinear(i, o, nblocks=nblocks)
    else:
        linear = nn.Linear
    return nn.Sequential(
        linear(64, hidden), nn.GELU(), linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10)
    )


def load_shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return x[rank::world], y[rank::world]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["monarch", "dense"], default="monarch")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--nblocks", type=int, default=4)
    args = p.parse_args(argv)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(make_model(args.model, args.hidden, args.nblocks))
    x, y = load_shard(rank, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        idx = torch.randint(len(x), (args.batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.barrier()
    elapsed = time.perf_counter() - start
    result = {
        "model": args.model,
        "world": world,
        "steps_per_s": args.steps / elapsed,
        "first_loss": sum(losses[:10]) / 10,
        "last_loss": sum(losses[-10:]) / 10,
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    if os.environ.get("TORCHELASTIC_RUN_ID") or "MASTER_PORT" in os.environ:
        dist.destroy_process_group()  # our own group; inside a cell the cluster's stays
    return result


if __name__ == "__main__":
    main()
