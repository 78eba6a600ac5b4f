"""Triton kernels for the Monarch product; the launchers are in ``triton_launch.py``.

Every kernel reads and writes through explicit strides over a logical ``(row, block, feature)``
index, so each permutation of the specification is index arithmetic in a load or a store,
never a copy:

* x block i, element c:                        ``x[b, i*p + c]``
* stage-1 output i, a -> flat intermediate m:  ``m = i*q + a``
* stage-2 input j, element rr:                 ``m = rr*l + j``
* stage-2 output j, element a:                 ``y[b, a*l + j]``

Global intermediates are stored feature-major, ``(k*q, B)``: a row tile of any block is then
BLOCK_M contiguous elements, so the stage-1 store and the permuted stage-2 load are both
coalesced along the batch, whatever the permutation does to the feature index.

The output permutation interleaves blocks (``y[b, a*l + j]``). Stage 2 writes block-major
instead, and ``_transpose_rows_kernel`` applies (or undoes) the permutation at copy speed;
``_batch_last_kernel`` does the same between ``y`` and the BLAS path's batch-last
``(l, s, B)``. ``_block_wgrad_kernel`` reduces the weight gradients in split partials, which
``_sum_splits_kernel`` finishes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_matmul(
    in_ptr,
    w_ptr,
    offs_m,
    mask_m,
    blk,
    o0,
    NRED,
    NOUT,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w_blk,
    stride_w_o,
    stride_w_c,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANS: tl.constexpr = False,
):
    """fp32 (BLOCK_M, BLOCK_O) tile of ``sum_c in[m, blk, c] * w[blk, o, c]``; with TRANS,
    the same tile transposed, (BLOCK_O, BLOCK_M), computed as ``w @ in.T`` (see
    ``_block_matmul_kernel``)."""
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_c = tl.arange(0, BLOCK_C)
    if TRANS:
        acc = tl.zeros((BLOCK_O, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    in_base = in_ptr + offs_m[:, None] * stride_in_m + blk * stride_in_blk
    w_base = w_ptr + blk * stride_w_blk + offs_o[None, :] * stride_w_o
    for c0 in range(0, NRED, BLOCK_C):
        cc = c0 + offs_c
        a = tl.load(
            in_base + cc[None, :] * stride_in_c,
            mask=mask_m[:, None] & (cc[None, :] < NRED),
            other=0.0,
        )
        w = tl.load(
            w_base + cc[:, None] * stride_w_c,
            mask=(cc[:, None] < NRED) & (offs_o[None, :] < NOUT),
            other=0.0,
        )  # (BLOCK_C, BLOCK_O): w[blk] transposed by its strides
        if TRANS:
            acc = tl.dot(tl.trans(w), tl.trans(a.to(w.dtype)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(w.dtype), w, acc, input_precision="ieee")
    return acc


@triton.jit
def _store_tile(
    out_ptr, acc, offs_m, offs_o, mask_m, mask_o, stride_m, stride_o, TRANS: tl.constexpr
):
    """Store a result tile at ``out[m*stride_m + o*stride_o]``: ``acc`` is (rows, outputs), or
    with TRANS the same tile held transposed, (outputs, rows) (see ``_block_matmul_kernel``)."""
    if TRANS:
        ptrs = out_ptr + offs_o[:, None] * stride_o + offs_m[None, :] * stride_m
        mask = mask_o[:, None] & mask_m[None, :]
    else:
        ptrs = out_ptr + offs_m[:, None] * stride_m + offs_o[None, :] * stride_o
        mask = mask_m[:, None] & mask_o[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_order(NBLK, NOUT, BLOCK_O: tl.constexpr):
    """(row tile, block, first output) of this program, blocks fastest.

    Programs that write the same output rows then run side by side: where blocks interleave
    in the output (``y[b, a*l + j]``) each 32-byte sector is completed in L2 by neighbouring
    programs within a moment, instead of lingering half-written until HBM must read it back
    to merge (measured 40x slower on an H200 with rows fastest).
    """
    pid = tl.program_id(0)
    n_o = tl.cdiv(NOUT, BLOCK_O)
    rest = pid // NBLK
    return rest // n_o, pid % NBLK, (rest % n_o) * BLOCK_O


@triton.jit
def _block_matmul_kernel(
    in_ptr,
    w_ptr,
    out_ptr,
    B,
    NBLK,
    NOUT,
    NRED,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w_blk,
    stride_w_o,
    stride_w_c,
    stride_out_m,
    stride_out_blk,
    stride_out_o,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANS_OUT: tl.constexpr = False,
):
    """One block-diagonal stage: ``out[m, blk, o] = sum_c in[m, blk, c] * w[blk, o, c]``.

    1-d grid over (row tiles, output tiles, blocks), blocks fastest. Used where the output's
    feature index is contiguous (stage 1, the backward).

    ``TRANS_OUT`` (the launcher sets it where the output is batch-contiguous, the
    feature-major intermediates) computes the tile transposed, rows of features by columns
    of batch rows. A matrix unit's result tile is stored along its columns: on AMD, where
    Triton stores MFMA results without rearranging them, the untransposed tile went out one
    bf16 at a time (``global_store_short``), the transposed one as 8-byte vectors from
    consecutive lanes. NVIDIA's stores come out as 16-byte vectors either way.
    """
    pid_m, blk, o0 = _tile_order(NBLK, NOUT, BLOCK_O)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < B
    acc = _tile_matmul(
        in_ptr, w_ptr, offs_m, mask_m, blk, o0, NRED, NOUT,
        stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
        BLOCK_M, BLOCK_O, BLOCK_C, TRANS_OUT,
    )  # fmt: skip
    offs_o = o0 + tl.arange(0, BLOCK_O)
    out = out_ptr + blk * stride_out_blk
    _store_tile(
        out, acc, offs_m, offs_o, mask_m, offs_o < NOUT, stride_out_m, stride_out_o, TRANS_OUT
    )


@triton.jit
def _block_wgrad_kernel(
    a_ptr,
    b_ptr,
    partial_ptr,
    B,
    NBLK,
    NOUT,
    NRED,
    ROWS_PER_SPLIT,
    stride_a_m,
    stride_a_blk,
    stride_a_o,
    stride_b_m,
    stride_b_blk,
    stride_b_c,
    stride_p_split,
    stride_p_blk,
    stride_p_o,
    stride_p_c,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``partial[split, blk, o, c] = sum over rows m of the split of a[m, blk, o] * b[m, blk, c]``.

    Grid: (splits, NBLK, output tiles). Each program reduces its rows in a fixed order and
    writes its own partial; the caller sums the splits, so the result is deterministic and
    needs no atomics.
    """
    split = tl.program_id(0)
    blk = tl.program_id(1)
    n_c = tl.cdiv(NRED, BLOCK_C)
    o0 = (tl.program_id(2) // n_c) * BLOCK_O
    c0 = (tl.program_id(2) % n_c) * BLOCK_C
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    row0 = split * ROWS_PER_SPLIT
    row_end = tl.minimum(row0 + ROWS_PER_SPLIT, B)
    acc = tl.zeros((BLOCK_O, BLOCK_C), dtype=tl.float32)
    for m0 in range(row0, row_end, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = offs_m < row_end
        a = tl.load(
            a_ptr
            + offs_m[None, :] * stride_a_m
            + blk * stride_a_blk
            + offs_o[:, None] * stride_a_o,
            mask=mask_m[None, :] & (offs_o[:, None] < NOUT),
            other=0.0,
        )  # (BLOCK_O, BLOCK_M)
        b = tl.load(
            b_ptr
            + offs_m[:, None] * stride_b_m
            + blk * stride_b_blk
            + offs_c[None, :] * stride_b_c,
            mask=mask_m[:, None] & (offs_c[None, :] < NRED),
            other=0.0,
        )  # (BLOCK_M, BLOCK_C)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
    p = partial_ptr + split * stride_p_split + blk * stride_p_blk
    tl.store(
        p + offs_o[:, None] * stride_p_o + offs_c[None, :] * stride_p_c,
        acc,
        mask=(offs_o[:, None] < NOUT) & (offs_c[None, :] < NRED),
    )


@triton.jit
def _transpose_rows_kernel(
    in_ptr,
    out_ptr,
    B,
    stride_in_m,
    stride_out_m,
    P: tl.constexpr,
    Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """``out[m, v*P + u] = in[m, u*Q + v]``: each row, read as a P x Q matrix, transposed.

    With (P, Q) = (s, l) this undoes the output permutation (``dy[b, a*l + j]`` to block-major
    ``j*s + a``, once for the backward's three readers); with (l, s) it applies it (block-major
    stage-2 results to ``y[b, a*l + j]``). Grid: (row tiles, P tiles, Q tiles). The tile is read
    with v contiguous and written with u contiguous; the compiler turns it around in shared
    memory, which runs at copy speed where scattered stores from the matmul kernels do not.

    P and Q are compile-time constants (one compilation per pair of block count and width):
    the compiler then knows where each run of inputs and outputs starts and which lanes the
    masks cut, so short runs (P or Q of 2 to 8: a few blocks) move as vectors too; from
    run-time sizes it infers that only for multiples of 16.
    """
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_u = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_v = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m3 = offs_m[:, None, None]
    u3 = offs_u[None, :, None]
    v3 = offs_v[None, None, :]
    src = m3 * stride_in_m + u3 * Q
    dst = m3 * stride_out_m + v3 * P
    mask = (m3 < B) & (u3 < P) & (v3 < Q)
    tile = tl.load(in_ptr + src + v3, mask=mask)
    tl.store(out_ptr + dst + u3, tile, mask=mask)


@triton.jit
def _batch_last_kernel(
    flat_ptr,
    blk_ptr,
    B,
    S,
    L,
    stride_flat_m,
    stride_flat_o,
    stride_blk_j,
    stride_blk_a,
    stride_blk_m,
    TO_FLAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """Between batch-first ``flat[m, a*L + j]`` and batch-last, block-major ``blk[j, a, m]``.

    ``TO_FLAT`` applies the output permutation to the BLAS path's stage-2 result (``yt``, see
    ``blas.py``); otherwise it puts the output gradient into that path's order. Grid: (row
    tiles, output-feature tiles). The flat side is contiguous along o, the block side along m;
    the compiler turns the tile around in shared memory, so both sides are coalesced.
    """
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    a = offs_o // L
    j = offs_o - a * L
    mask = (offs_m[:, None] < B) & (offs_o[None, :] < S * L)
    flat = flat_ptr + offs_m[:, None] * stride_flat_m + offs_o[None, :] * stride_flat_o
    blk = blk_ptr + offs_m[:, None] * stride_blk_m + (j * stride_blk_j + a * stride_blk_a)[None, :]
    if TO_FLAT:
        tl.store(flat, tl.load(blk, mask=mask), mask=mask)
    else:
        tl.store(blk, tl.load(flat, mask=mask), mask=mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr, out1_ptr, out2_ptr, N1, N, SPLITS, stride_split, BLOCK: tl.constexpr
):
    """``out1 ‖ out2 = sum over splits of part[split, :]``, summed in float32 in split order
    (deterministic) and stored in the outputs' dtype: both weight gradients' partials (laid
    side by side, ``N1`` and ``N - N1`` values) finished in one launch. Grid: column tiles."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(0, SPLITS):
        acc += tl.load(partial_ptr + sp * stride_split + cols, mask=mask, other=0.0)
    first = cols < N1
    tl.store(out1_ptr + cols, acc.to(out1_ptr.dtype.element_ty), mask=mask & first)
    rest = tl.where(first, 0, cols - N1)  # masked lanes keep a valid offset
    tl.store(out2_ptr + rest, acc.to(out2_ptr.dtype.element_ty), mask=mask & ~first)
