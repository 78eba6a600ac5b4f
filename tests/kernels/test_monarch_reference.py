# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The reference against a literal, loop-by-loop reading of the specification."""

from __future__ import annotations

import pytest
import torch
from monarch_kernels import monarch_dense, monarch_reference

# (k, p, q, l, s): k != l, in != out, k != sqrt(n); and one square case, k = l = sqrt(n)
SHAPES = [(4, 6, 5, 5, 3), (2, 8, 12, 3, 5), (3, 2, 4, 6, 7), (4, 4, 4, 4, 4)]


def literal(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Steps 1-4 of the specification, one scalar at a time, for a single row x (n,)."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    flat = torch.zeros(k * q, dtype=x.dtype)
    for i in range(k):
        for a in range(q):
            flat[i * q + a] = sum(w1[i, a, c] * x[i * p + c] for c in range(p))
    out = torch.zeros(s * l, dtype=x.dtype)
    for j in range(l):
        g = [flat[rr * l + j] for rr in range(r)]  # (r, l) -> (l, r)
        for a in range(s):
            out[a * l + j] = sum(w2[j, a, rr] * g[rr] for rr in range(r))
    return out


def factors(shape, dtype=torch.float64, seed=0):
    k, p, q, l, s = shape
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(k, q, p, generator=g, dtype=dtype)
    w2 = torch.randn(l, s, k * q // l, generator=g, dtype=dtype)
    return w1, w2


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_literal_specification(shape):
    w1, w2 = factors(shape)
    x = torch.randn(3, shape[0] * shape[1], dtype=torch.float64)
    got = monarch_reference(x, w1, w2)
    for row in range(3):
        torch.testing.assert_close(got[row], literal(x[row], w1, w2))


def test_reference_batch_dims_and_dense():
    w1, w2 = factors(SHAPES[0])
    x = torch.randn(2, 3, 5, 24, dtype=torch.float64)
    y = monarch_reference(x, w1, w2)
    assert y.shape == (2, 3, 5, 15)
    torch.testing.assert_close(y, x @ monarch_dense(w1, w2).T)
    torch.testing.assert_close(monarch_reference(x[0, 0, 0], w1, w2), y[0, 0, 0])


def perm(rows: int, cols: int) -> torch.Tensor:
    """Permutation matrix P with (P v)[c*rows + r] = v[r*cols + c]: (rows cols) -> (cols rows)."""
    eye = torch.eye(rows * cols, dtype=torch.float64)
    return eye.view(rows, cols, -1).transpose(0, 1).reshape(rows * cols, -1)


@pytest.mark.parametrize("shape", [(4, 4, 4, 4, 4), (2, 6, 3, 3, 5)])
def test_dense_is_permuted_block_diagonals(shape):
    k, _p, q, l, s = shape
    r = k * q // l
    w1, w2 = factors(shape)
    R = torch.block_diag(*w1)
    L = torch.block_diag(*w2)
    M = perm(l, s) @ L @ perm(r, l) @ R
    torch.testing.assert_close(monarch_dense(w1, w2), M)
    if shape[0] == shape[3] == 4 and shape[1] == shape[2] == 4:  # the paper's M = P L P^T R
        P = perm(4, 4)
        torch.testing.assert_close(P, P.T)
        torch.testing.assert_close(monarch_dense(w1, w2), P @ L @ P.T @ R)


def test_shape_errors_name_expected_shapes():
    w1, w2 = factors(SHAPES[0])
    with pytest.raises(ValueError, match=r"expected x \(\.\.\., 24\)"):
        monarch_reference(torch.randn(3, 25, dtype=torch.float64), w1, w2)
    with pytest.raises(ValueError, match=r"l \* r == k \* q == 20"):
        monarch_reference(torch.randn(3, 24, dtype=torch.float64), w1, w2[:, :, :3])
    with pytest.raises(ValueError, match="3-d"):
        monarch_reference(torch.randn(3, 24), w1[0], w2)
