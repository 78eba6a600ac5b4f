# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Plain-torch Monarch product: the specification every kernel is tested against.

Shapes, for an input ``x`` of width ``n``:

* ``w1``: ``(k, q, p)`` with ``k * p == n`` — k block-diagonal blocks of stage 1;
* ``w2``: ``(l, s, r)`` with ``l * r == k * q`` — l block-diagonal blocks of stage 2;
* output: ``(..., s * l)``.

1. x is split into k contiguous blocks of width p; block i is multiplied by ``w1[i]``;
2. the ``k * q`` results are viewed as ``(r, l)`` and transposed to ``(l, r)``;
3. block j is multiplied by ``w2[j]``;
4. element a of block j lands at output index ``a * l + j`` (``(l s) -> (s l)``).

With k = l = sqrt(n) and square blocks this is the paper's M = P L P^T R.
"""

from __future__ import annotations

import torch


def monarch_shapes(n: int, w1: torch.Tensor, w2: torch.Tensor) -> tuple[int, ...]:
    """Return ``(k, q, p, l, s, r)`` after checking the shapes against the specification."""
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"monarch: w1 and w2 must be 3-d (k, q, p) and (l, s, r), got shapes "
            f"{tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    k, q, p = w1.shape
    l, s, r = w2.shape
    if k * p != n:
        raise ValueError(
            f"monarch: input width {n} does not match w1 {tuple(w1.shape)}: expected "
            f"x (..., {k * p}) for w1 (k={k}, q={q}, p={p})"
        )
    if l * r != k * q:
        raise ValueError(
            f"monarch: w2 {tuple(w2.shape)} does not match w1 {tuple(w1.shape)}: expected "
            f"l * r == k * q == {k * q}, got {l} * {r} == {l * r}"
        )
    return k, q, p, l, s, r


def monarch_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Monarch product of ``x`` (..., n) with factors ``w1`` (k, q, p) and ``w2`` (l, s, r)."""
    k, _q, p, l, s, r = monarch_shapes(x.shape[-1], w1, w2)
    batch = x.shape[:-1]
    h = torch.einsum("...kp,kqp->...kq", x.reshape(*batch, k, p), w1)  # (..., k, q)
    g = h.reshape(*batch, r, l).transpose(-1, -2)  # (..., l, r): element rr of block j
    y = torch.einsum("...lr,lsr->...ls", g, w2)  # (..., l, s)
    return y.transpose(-1, -2).reshape(*batch, s * l)  # index a * l + j


def monarch_dense(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The dense ``(s * l, k * p)`` matrix M with ``monarch_reference(x) == x @ M.T``."""
    n = w1.shape[0] * w1.shape[-1] if w1.dim() == 3 else 0  # monarch_shapes names a bad w1
    eye = torch.eye(n, dtype=w1.dtype, device=w1.device)
    return monarch_reference(eye, w1, w2).T
