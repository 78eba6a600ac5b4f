"""A pipeline stage's training loop (notebook 08), run on every rank of a ``pp`` mesh: the first
stage feeds the batch, the last computes the loss of each micro-batch, the others pass on."""

from __future__ import annotations

import torch
from monarch_kernels.tp_bytes import written_bytes

from monarch_nb.examples.transformer import STEPS, Trained, batch


def train_stage(schedule, stage_index: int, stages: int, opt, log=None, steps=range(STEPS)):
    """``schedule.step`` (a ``torch.distributed.pipelining`` schedule of this rank's stage) and
    ``opt.step`` for ``steps``; returns the whole batch's loss after each step on the last stage
    (an empty list on the others), with ``.sent`` the bytes this process wrote a step."""
    x, y = batch()
    losses, written = Trained(), written_bytes()
    for step in steps:
        opt.zero_grad()
        micro: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(x)
        elif stage_index == stages - 1:
            schedule.step(target=y, losses=micro)
        else:
            schedule.step()
        opt.step()
        if micro:
            losses.append(torch.stack(micro).mean().item())
            if log:
                log(step=step, loss=losses[-1])
    losses.sent = (written_bytes() - written) / max(len(steps), 1)
    return losses
