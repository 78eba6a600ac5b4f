"""Dense -> Monarch projection: exact on Monarch matrices, Frobenius-optimal otherwise.

Only products are compared: the factors of a Monarch matrix are not unique.
"""

from __future__ import annotations

import pytest
import torch
from monarch_kernels import monarch_dense, project_to_monarch


def monarch(nblocks, p, s, q, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(nblocks, q, p, generator=g, dtype=torch.float64)
    w2 = torch.randn(nblocks, s, q, generator=g, dtype=torch.float64)
    return monarch_dense(w1, w2)


# (nblocks, p, s, q): square sqrt(n) case, in != out, q > nblocks (rank > 1 per pair),
# q not a multiple of nblocks (pair ranks differ), q < nblocks (some pairs empty)
@pytest.mark.parametrize(
    "shape", [(4, 4, 4, 4), (4, 6, 3, 3), (2, 8, 5, 5), (3, 4, 7, 4), (4, 2, 3, 2)]
)
def test_exact_on_monarch_matrices(shape):
    nblocks, p, s, q = shape
    M = monarch(*shape)
    w1, w2 = project_to_monarch(M, nblocks, q=q)
    assert w1.shape == (nblocks, q, p) and w2.shape == (nblocks, s, q)
    torch.testing.assert_close(monarch_dense(w1, w2), M, rtol=1e-9, atol=1e-9)


def test_default_q_is_smaller_block():
    M = monarch(4, 6, 3, 3)
    w1, w2 = project_to_monarch(M, 4)
    assert w1.shape[1] == 3
    torch.testing.assert_close(monarch_dense(w1, w2), M, rtol=1e-9, atol=1e-9)


def test_optimal_in_frobenius_norm():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(24, 16, generator=g, dtype=torch.float64)
    w1, w2 = project_to_monarch(W, 4)
    best = (monarch_dense(w1, w2) - W).norm()
    assert 0 < best < W.norm()
    for seed in range(5):
        gg = torch.Generator().manual_seed(10 + seed)
        d1 = 1e-2 * torch.randn(w1.shape, generator=gg, dtype=torch.float64)
        d2 = 1e-2 * torch.randn(w2.shape, generator=gg, dtype=torch.float64)
        assert (monarch_dense(w1 + d1, w2 + d2) - W).norm() > best


def test_float32_and_bad_input():
    M = monarch(4, 4, 4, 4).float()
    w1, w2 = project_to_monarch(M, 4)
    assert w1.dtype == torch.float32
    torch.testing.assert_close(monarch_dense(w1, w2), M, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not divisible into nblocks=5"):
        project_to_monarch(M, 5)
    with pytest.raises(ValueError, match="2-d"):
        project_to_monarch(M[0], 4)
    with pytest.raises(TypeError, match="float dtype"):
        project_to_monarch(M.long(), 4)
