# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The Monarch product's block products on the vendor BLAS (``torch.bmm``), batch-last.

Both the CPU torch path (``ops.py``) and the GPU's ``blas`` path (``triton_launch.py``)
work in this orientation: they compute ``out.T`` (s*l, B) from
``x.T`` (n, B). There the ``(r l) -> (l r)`` permutation between the stages acts on the *row*
index of a column-major-ish operand, so it is a leading dimension that BLAS accepts and is
never copied:

* ``x.T`` block i is ``x.view(B, k, p).permute(1, 2, 0)[i]`` (p, B), a transposed operand;
* stage 1 writes ``h.T`` (k*q, B) contiguously; viewed as (r, l, B) and transposed it *is* the
  stage-2 operand (l, r, B), with row stride l*B.

What is left is the output permutation between batch-last, block-major ``(l, s, B)`` and the
batch-first ``y[b, a*l + j]``; the callers do that one transpose their own way.
"""

from __future__ import annotations

import torch


def stage_one(x2: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """``h.T`` (k, q, B) for ``x2`` (B, k*p): block i of ``x.T`` is a transposed operand."""
    k, _q, p = w1.shape
    return torch.bmm(w1, x2.unflatten(1, (k, p)).permute(1, 2, 0))


def forward_stages(
    x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ht, yt)``: the intermediate ``h.T`` (k, q, B) and the output block-major and
    batch-last, ``yt[j, a, b] = y[b, a*l + j]`` (l, s, B)."""
    l, _s, r = w2.shape
    ht = stage_one(x2, w1)
    return ht, torch.bmm(w2, ht.view(r, l, x2.shape[0]).transpose(0, 1))


def input_grads(
    dyt: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, strided_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dht, dx)`` from ``dyt`` (l, s, B), the output gradient block-major and batch-last:
    ``dht`` (k, q, B) is the intermediate's gradient (the transposed product's stage 1, whose
    (l r) -> (r l) permutation is again a leading dimension) and ``dx`` (B, k*p).

    ``strided_out`` has the GEMMs write straight into the permuted layouts through strided
    ``out=`` views, which cuBLAS and hipBLAS take as leading dimensions; the CPU's BLAS path
    falls back to a slow loop there, so on CPU the results are permuted by copies instead.
    """
    k, q, p = w1.shape
    l, _s, r = w2.shape
    b = dyt.shape[2]
    if strided_out:
        dht = dyt.new_empty(k, q, b)
        torch.bmm(w2.transpose(1, 2), dyt, out=dht.view(r, l, b).transpose(0, 1))
        dx = dyt.new_empty(b, k * p)
        torch.bmm(dht.transpose(1, 2), w1, out=dx.view(b, k, p).transpose(0, 1))
        return dht, dx
    dgt = torch.bmm(w2.transpose(1, 2), dyt)  # (l, r, B)
    dht = dgt.transpose(0, 1).reshape(k, q, b)  # dF.T (r, l, B) == dH.T (k, q, B)
    dx = torch.bmm(dht.transpose(1, 2), w1)  # (k, B, p)
    return dht, dx.transpose(0, 1).reshape(b, k * p)


def weight_grads(
    dyt: torch.Tensor, dht: torch.Tensor, x2: torch.Tensor, ht: torch.Tensor, l: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dw1, dw2)`` from the output gradient ``dyt`` (l, s, B), the intermediate's gradient
    ``dht`` (k, q, B), ``x2`` (B, k*p) and the intermediate ``ht`` (k, q, B)."""
    k, q, b = dht.shape
    r = k * q // l
    dw1 = torch.bmm(dht, x2.unflatten(1, (k, -1)).transpose(0, 1))  # (k, q, B) @ (k, B, p)
    dw2 = torch.bmm(dyt, ht.view(r, l, b).permute(1, 2, 0))  # (l, s, B) @ (l, B, r)
    return dw1, dw2
