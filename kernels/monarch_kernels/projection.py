# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Dense -> Monarch projection (Dao et al. 2022, Algorithm 1, for any block counts).

Write the dense ``(s*l, k*p)`` matrix M in block pairs: rows ``a*l + j`` (output block j),
columns ``i*p + c`` (input block i). In the Monarch product, row ``a'`` of ``w1[i]`` feeds
stage-1 flat index ``m = i*q + a'``, which is element ``rr = m // l`` of stage-2 block
``j = m % l``. So the (j, i) block pair of M is

    M[j::l, i*p:(i+1)*p] = sum over a' in A(j, i) of  w2[j, :, rr(a')] outer w1[i, a', :]

with ``A(j, i) = {a' : (i*q + a') % l == j}``. Every parameter appears in exactly one block
pair, so the pairs decouple: the Frobenius-optimal projection is the best rank-|A(j, i)|
approximation of each block pair (Eckart-Young, by SVD), and it is exact when M is a Monarch
matrix. In the paper's square case (k = l = q = sqrt(n)) |A| = 1: one rank-1 SVD per pair.
"""

from __future__ import annotations

import torch


def project_to_monarch(
    weight: torch.Tensor, nblocks: int, q: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project a dense ``(out, in)`` weight onto Monarch factors ``(w1, w2)``.

    ``in`` and ``out`` must be divisible by ``nblocks``; ``w1`` is ``(nblocks, q, in/nblocks)``
    and ``w2`` is ``(nblocks, out/nblocks, q)``, with ``q`` defaulting to the smaller block
    size (the layout of :class:`monarch_kernels.MonarchLinear`). ``monarch_matmul(x, w1, w2)``
    then approximates ``x @ weight.T``, optimally in Frobenius norm.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"project_to_monarch: weight must be 2-d (out, in), got {tuple(weight.shape)}"
        )
    if not weight.dtype.is_floating_point:
        raise TypeError(
            f"project_to_monarch: weight has dtype {weight.dtype}; expected a float dtype"
        )
    out_f, in_f = weight.shape
    if nblocks < 1 or in_f % nblocks or out_f % nblocks:
        raise ValueError(
            f"project_to_monarch: weight {tuple(weight.shape)} is not divisible into "
            f"nblocks={nblocks} blocks on both sides; pad it first"
        )
    k = l = nblocks
    p, s = in_f // k, out_f // l
    q = min(p, s) if q is None else q
    if q < 1:
        raise ValueError(f"project_to_monarch: q={q} must be >= 1")
    r = q  # k * q == l * r with k == l
    work = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    # (l, k, s, p): pair (j, i) holds M[j::l, i*p:(i+1)*p]
    pairs = work.view(s, l, k, p).permute(1, 2, 0, 3)
    u, sv, vh = torch.linalg.svd(
        pairs, full_matrices=False
    )  # (l, k, s, t), (l, k, t), (l, k, t, p)
    root = sv.sqrt()
    w1 = work.new_zeros(k, q, p)
    w2 = work.new_zeros(l, s, r)
    m = torch.arange(k * q, device=work.device).view(k, q)  # stage-1 flat index of w1[i, a']
    for i in range(k):
        for j in range(l):
            rows = torch.nonzero(m[i] % l == j).flatten()  # A(j, i)
            t = min(rows.numel(), sv.shape[-1])
            if t == 0:
                continue
            rows = rows[:t]
            w1[i, rows] = root[j, i, :t, None] * vh[j, i, :t]
            w2[j, :, m[i, rows] // l] = u[j, i, :, :t] * root[j, i, :t]
    return w1.to(weight.dtype), w2.to(weight.dtype)
