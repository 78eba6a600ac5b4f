"""The small transformer the parallelism notebooks (07-09) train every way, and its reference.

Run on every rank and in the notebook's kernel alike (``%%monarch --local``): four blocks of
causal self-attention (4 heads) and an MLP, trained with plain SGD on one fixed random batch to
reproduce a fixed random target, so that each strategy's losses can be set beside those of the
same model trained in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from monarch_kernels.tp_bytes import written_bytes
from torch import nn

DIM, HEADS, BLOCKS, STEPS = 32, 4, 4, 8
BATCH, SEQ = 8, 16


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1: the heads this rank holds (all of them, or a share under tensor parallelism)
        q, k, v = (
            f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_model(seed: int = 0) -> nn.Sequential:
    """The model, with the same initial weights wherever it is built from the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*(Block() for _ in range(BLOCKS)))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: inputs and targets, (BATCH, SEQ, DIM) each, the same everywhere."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


class Trained(list):
    """The whole batch's loss after each step, and ``sent``: the bytes this process wrote per
    step while training (on CPU ranks, what gloo sent to the other ranks)."""

    sent: float = 0.0


def train(model, dp=None, log=None, opt=None, steps=range(STEPS)) -> Trained:
    """SGD (or ``opt``) on this rank's share of the batch (its place along the mesh dimension
    ``dp``, a ``DeviceMesh``), for ``steps``; ``log`` (``monarch_nb.log``) gets each step's
    loss."""
    x, y = batch()
    if dp is not None:
        share = dp.get_local_rank()
        x, y = x.chunk(dp.size())[share], y.chunk(dp.size())[share]
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    losses = Trained()
    written = written_bytes()
    for step in steps:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if dp is not None:  # the mean over the dp ranks' shares: the whole batch's loss
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
        if log:
            log(step=step, loss=loss)
        losses.append(loss.item())
    losses.sent = (written_bytes() - written) / max(len(steps), 1)
    return losses


def who_holds(shard, build=make_model) -> dict[str, tuple[tuple[int, ...], list[int]]]:
    """Which entries of each weight this rank holds once ``shard`` has split the model: shard a
    copy whose entries are their own indices and read them back. {name: (shape, indices)}."""
    probe = build()
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p))
    probe = shard(probe)
    held = {}
    for name, p in probe.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held[name] = (tuple(p.shape), local.detach().flatten().long().tolist())
    return held
