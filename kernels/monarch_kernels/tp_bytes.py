# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Bytes one rank sends to the others per forward and backward: a sharded Monarch layer, and
dense column- then row-parallel tensor parallelism (Megatron's MLP, torch's ``ColwiseParallel``
and ``RowwiseParallel``) of the same widths.

The counts are of bandwidth-optimal algorithms, which is what gloo and NCCL run on large
tensors: an all-to-all sends every row bound for another rank once; an all-gather sends the
rank's part to each of the d-1 others; an all-reduce of N elements (a ring's reduce-scatter and
all-gather) sends ``2 (d-1) N / d``. :func:`written_bytes` measures them on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import MonarchLinear
from .sharded import (
    INPUT_LAYOUTS,
    OUTPUT_LAYOUTS,
    ShardedMonarchLinear,
    output_route,
    permutation_route,
)


@dataclass(frozen=True)
class CommBytes:
    """Per collective, ``(what, bytes this rank sends)``, in the forward and the backward."""

    forward: tuple[tuple[str, int], ...]
    backward: tuple[tuple[str, int], ...]

    @property
    def forward_bytes(self) -> int:
        return sum(n for _, n in self.forward)

    @property
    def backward_bytes(self) -> int:
        return sum(n for _, n in self.backward)

    @property
    def step_bytes(self) -> int:
        """Forward and backward: one training step."""
        return self.forward_bytes + self.backward_bytes

    def __add__(self, other: CommBytes) -> CommBytes:
        """Two layers' collectives, in the order they run."""
        return CommBytes(self.forward + other.forward, other.backward + self.backward)


def monarch_tp_bytes(
    layer: MonarchLinear | ShardedMonarchLinear,
    batch: int,
    world: int | None = None,
    *,
    rank: int | None = None,
    input_layout: str | None = None,
    output_layout: str | None = None,
    input_grad: bool = True,
) -> CommBytes:
    """What ``layer`` sharded over ``world`` ranks sends per forward and backward of ``batch``
    rows, in the weights' dtype.

    A :class:`ShardedMonarchLinear` brings its world, rank and layouts; a
    :class:`MonarchLinear` is counted as :meth:`ShardedMonarchLinear.from_linear` would shard
    it (``world`` needed; layouts "replicated" unless given). ``rank=None`` counts the rank
    that sends the most (they send the same where ``d`` divides ``q``). ``input_grad=False``:
    the input needs no gradient (a first layer), so a replicated input's backward all-gather
    does not run.

    >>> monarch_tp_bytes(MonarchLinear(1024, 1024, nblocks=4), batch=512, world=2).step_bytes
    3145728
    """
    if isinstance(layer, ShardedMonarchLinear):
        world, rank = layer.world, layer.rank if rank is None else rank
        input_layout = input_layout or layer.input_layout
        output_layout = output_layout or layer.output_layout
        k, q, p, l, s, _r = layer.shapes
    elif isinstance(layer, MonarchLinear):
        if world is None:
            raise ValueError("monarch_tp_bytes: pass world=, the number of ranks to shard over")
        (k, q, p), (l, s, _r) = layer.w1.shape, layer.w2.shape
    else:
        raise TypeError(f"monarch_tp_bytes: expected a Monarch layer, got {type(layer).__name__}")
    input_layout, output_layout = input_layout or "replicated", output_layout or "replicated"
    if input_layout not in INPUT_LAYOUTS or output_layout not in OUTPUT_LAYOUTS:
        raise ValueError(
            f"monarch_tp_bytes: layouts {input_layout!r}, {output_layout!r}; the input is one of "
            f"{', '.join(INPUT_LAYOUTS)} and the output one of {', '.join(OUTPUT_LAYOUTS)}"
        )
    if k % world or l % world:
        raise ValueError(f"monarch_tp_bytes: {k} and {l} blocks do not divide among {world} ranks")
    size = batch * layer.w1.element_size()
    ranks = range(world) if rank is None else [rank]
    counts = []
    for t in ranks:
        perm = permutation_route(k, q, l, world, t)
        forward = [("all-to-all, the Monarch permutation", perm.sent_rows(t) * size)]
        backward = [("all-to-all, the Monarch permutation", perm.sent_rows(t, True) * size)]
        if output_layout == "replicated":
            forward.append(("all-gather, the output", (world - 1) * s * l // world * size))
        elif output_layout == "sharded":
            out = output_route(l, s, world, t)
            forward.append(("all-to-all, output to contiguous shards", out.sent_rows(t) * size))
            backward.insert(
                0, ("all-to-all, output to contiguous shards", out.sent_rows(t, True) * size)
            )
        if input_layout == "replicated" and input_grad:
            backward.append(("all-gather, the input gradient", (world - 1) * k * p // world * size))
        counts.append(CommBytes(tuple(forward), tuple(backward)))
    return max(counts, key=lambda c: c.step_bytes)


def dense_tp_bytes(
    in_features: int,
    out_features: int,
    batch: int,
    world: int,
    *,
    dtype: torch.dtype = torch.float32,
    input_grad: bool = True,
) -> CommBytes:
    """What dense tensor parallelism sends for ``nn.Linear(in_features, h)`` column-parallel
    then ``nn.Linear(h, out_features)`` row-parallel, input and output replicated (any h):
    an all-reduce of the output in the forward, and of the input's gradient in the backward
    (none with ``input_grad=False``). For widths that ``world`` divides.

    >>> dense_tp_bytes(1024, 1024, batch=512, world=2).step_bytes
    4194304
    """
    size = batch * torch.empty((), dtype=dtype).element_size()
    forward = (("all-reduce, the output", 2 * (world - 1) * out_features * size // world),)
    backward = ()
    if input_grad:
        backward = (
            ("all-reduce, the input gradient", 2 * (world - 1) * in_features * size // world),
        )
    return CommBytes(forward, backward)


def written_bytes() -> int | None:
    """Bytes this process has passed to ``write`` system calls so far (Linux's
    ``/proc/self/io``, ``wchar``), None where that file is missing. gloo's TCP transport sends
    through them, so across a step the difference is what this rank sent to the others, plus
    about 144 bytes of header per message (and whatever else the process wrote)."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
