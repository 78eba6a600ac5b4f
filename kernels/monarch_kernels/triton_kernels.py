"""Triton kernels for the Monarch product. Launchers live in ``forward_launch.py``
and ``backward_launch.py``, on the ground ``triton_launch.py`` lays.

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

The output permutation interleaves blocks (``y[b, a*l + j]``): ``_block_group_kernel`` joins
several blocks' tiles so that each thread stores a run of consecutive outputs, and
``_transpose_rows_kernel`` applies (or undoes) the permutation at copy speed for the paths
that keep data block-major; ``_batch_last_kernel`` does the same between ``y`` and the BLAS
path's batch-last ``(l, s, B)``. ``_sum_splits_kernel`` finishes the weight gradients' split
partials.

Why the fused forward uses an L2 scratch rather than registers: stage-2 block j needs element
``rr*l + j`` of the stage-1 output for every rr, i.e. q/l elements from every stage-1 block
when l <= q (one each in the square case). A row tile therefore needs its whole
``BLOCK_M x k*q`` intermediate before stage 2 can start. At width 4096 and BLOCK_M=16 that is
64K fp32 values (256 KB): more than an SM's whole register file, and Triton has no explicit
shared-memory buffers. So each persistent program owns a private slot of ``BLOCK_M x k*q``
elements in global memory, writes stage 1 there, synchronises its threads and reads it back
permuted. It is correct on an H200 but slower than the other paths (it walks the blocks one
after another with few loads in flight), so it runs only when ``MONARCH_KERNELS_PATH=fused``.
The one-launch forward that hands row tiles between programs instead is in
``pipeline_kernel.py``.
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
def _tile_order(NBLK, NOUT, NGROUP: tl.constexpr, BLOCK_O: tl.constexpr):
    """(row tile, first block, first output) of this program, blocks fastest.

    Programs that write the same output rows then run side by side: where blocks interleave
    in the output (``y[b, a*l + j]``) each 32-byte sector is completed in L2 by neighbouring
    programs within a moment, instead of lingering half-written until HBM must read it back
    to merge (measured 40x slower on an H200 with rows fastest).
    """
    pid = tl.program_id(0)
    groups = NBLK // NGROUP
    n_o = tl.cdiv(NOUT, BLOCK_O)
    blk0 = (pid % groups) * NGROUP
    rest = pid // groups
    return rest // n_o, blk0, (rest % n_o) * BLOCK_O


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
    pid_m, blk, o0 = _tile_order(NBLK, NOUT, 1, BLOCK_O)
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
def _interleaved_tiles(
    in_ptr,
    w_ptr,
    offs_m,
    mask_m,
    blk0,
    o0,
    NRED,
    NOUT,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w_blk,
    stride_w_o,
    stride_w_c,
    STEP: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Tiles of blocks ``blk0 + STEP*t`` (t < COUNT) joined along new trailing axes, so that
    ``reshape(..., (BLOCK_M, BLOCK_O, COUNT))`` has block ``blk0 + STEP*t`` at index t.

    Each tile is an ordinary 2-d dot (the widest matrix instructions the chip has); ``tl.join``
    pairs even and odd blocks recursively, which leaves consecutive blocks side by side in a
    thread's registers.
    """
    if COUNT == 1:
        return _tile_matmul(
            in_ptr, w_ptr, offs_m, mask_m, blk0, o0, NRED, NOUT,
            stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
            BLOCK_M, BLOCK_O, BLOCK_C,
        )  # fmt: skip
    else:
        even = _interleaved_tiles(
            in_ptr, w_ptr, offs_m, mask_m, blk0, o0, NRED, NOUT,
            stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
            2 * STEP, COUNT // 2, BLOCK_M, BLOCK_O, BLOCK_C,
        )  # fmt: skip
        odd = _interleaved_tiles(
            in_ptr, w_ptr, offs_m, mask_m, blk0 + STEP, o0, NRED, NOUT,
            stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
            2 * STEP, COUNT // 2, BLOCK_M, BLOCK_O, BLOCK_C,
        )  # fmt: skip
        return tl.join(even, odd)


@triton.jit
def _dense_interleaved_tiles(
    in_ptr,
    w_ptr,
    offs_m,
    mask_m,
    blk0,
    o0,
    NRED,
    NOUT,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w_blk,
    stride_w_o,
    stride_w_c,
    BLOCK_J: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The tiles of blocks ``blk0 + t`` (t < BLOCK_J) as one fp32 ``(BLOCK_M, BLOCK_O *
    BLOCK_J)`` accumulator, column ``o*BLOCK_J + t`` holding block ``blk0 + t``'s output
    ``o0 + o``: what ``_interleaved_tiles`` returns, reshaped.

    Each step of one loop reduces BLOCK_C features of one block against that block's
    weights, loaded into its own columns of a ``(BLOCK_C, BLOCK_O * BLOCK_J)`` operand (zeros
    in the other blocks' columns). That costs BLOCK_J times the multiply-adds, which narrow,
    memory-bound blocks have to spare; in exchange the group is one ordinary matmul tile
    whose loop the compiler pipelines across blocks, so the next blocks' loads are in flight
    while one block is multiplied (one block at a time, each of its loads waited for, is
    what the joined tiles compile to).
    """
    offs_c = tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_O * BLOCK_J)
    col_blk = cols % BLOCK_J
    col_o = o0 + cols // BLOCK_J
    acc = tl.zeros((BLOCK_M, BLOCK_O * BLOCK_J), dtype=tl.float32)
    in_rows = in_ptr + offs_m[:, None] * stride_in_m
    w_cols = w_ptr + col_o[None, :] * stride_w_o
    steps = tl.cdiv(NRED, BLOCK_C)
    for step in range(0, BLOCK_J * steps):
        t = step // steps
        cc = (step - t * steps) * BLOCK_C + offs_c
        a = tl.load(
            in_rows + (blk0 + t) * stride_in_blk + cc[None, :] * stride_in_c,
            mask=mask_m[:, None] & (cc[None, :] < NRED),
            other=0.0,
        )
        w = tl.load(
            w_cols + (blk0 + t) * stride_w_blk + cc[:, None] * stride_w_c,
            mask=(col_blk[None, :] == t) & (cc[:, None] < NRED) & (col_o[None, :] < NOUT),
            other=0.0,
        )  # (BLOCK_C, BLOCK_O * BLOCK_J): w[blk0 + t] transposed, in block t's columns
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision="ieee")
    return acc


@triton.jit
def _block_group_kernel(
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
    stride_out_o: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DENSE: tl.constexpr = False,
):
    """One stage, BLOCK_J consecutive blocks per program, for an output whose block index is
    the contiguous one (the forward's ``y[b, a*l + j]``).

    The blocks' tiles are joined so that each thread holds BLOCK_J consecutive outputs of one
    row and feature: one vector store of BLOCK_J elements instead of BLOCK_J scattered ones.
    ``stride_out_o`` (the block count, for y) is a compile-time constant, so the compiler knows
    each run starts on a multiple of BLOCK_J and stores it as a vector for block counts that
    are not multiples of 16 too.
    ``DENSE`` computes the group as one matmul tile instead (``_dense_interleaved_tiles``).
    BLOCK_J must divide NBLK (the launcher prunes configs that do not).
    """
    pid_m, blk0, o0 = _tile_order(NBLK, NOUT, BLOCK_J, BLOCK_O)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < B
    if DENSE:
        tiles = _dense_interleaved_tiles(
            in_ptr, w_ptr, offs_m, mask_m, blk0, o0, NRED, NOUT,
            stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
            BLOCK_J, BLOCK_M, BLOCK_O, BLOCK_C,
        )  # fmt: skip
    else:
        tiles = _interleaved_tiles(
            in_ptr, w_ptr, offs_m, mask_m, blk0, o0, NRED, NOUT,
            stride_in_m, stride_in_blk, stride_in_c, stride_w_blk, stride_w_o, stride_w_c,
            1, BLOCK_J, BLOCK_M, BLOCK_O, BLOCK_C,
        )  # fmt: skip
    acc = tl.reshape(tiles, (BLOCK_M, BLOCK_O, BLOCK_J))
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_j = blk0 + tl.arange(0, BLOCK_J)
    out = (
        out_ptr
        + offs_m[:, None, None] * stride_out_m
        + offs_o[None, :, None] * stride_out_o
        + offs_j[None, None, :] * stride_out_blk
    )
    tl.store(
        out,
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None, None] & (offs_o[None, :, None] < NOUT),
    )


@triton.jit
def _monarch_fused_kernel(
    in_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    scratch_ptr,
    B,
    K1,
    O1,
    C1,
    K2,
    O2,
    C2,
    SLOT_ROWS,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w1_blk,
    stride_w1_o,
    stride_w1_c,
    stride_w2_blk,
    stride_w2_o,
    stride_w2_c,
    stride_out_m,
    stride_out_blk,
    stride_out_o,
    stride_sw_blk,
    stride_sw_o,
    stride_sr_blk,
    stride_sr_c,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FULL_SCRATCH: tl.constexpr,
):
    """Both stages in one pass over the rows, persistent over row tiles.

    Stage A: ``t[m, blk, o] = sum_c in[m, blk, c] * w1[blk, o, c]``, stored at flat index
    ``blk*stride_sw_blk + o*stride_sw_o``. Stage B reads element c of its block ``blk`` at
    flat index ``blk*stride_sr_blk + c*stride_sr_c`` and multiplies by ``w2[blk]``. The flat
    index strides encode the ``(r l) -> (l r)`` permutation of the forward, or its inverse for
    the input gradient. Scratch is feature-major: flat index f, row m at ``f*SLOT_ROWS + m``,
    in a private slot per program, or (FULL_SCRATCH) a ``(K1*O1, B)`` buffer the caller keeps.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot = scratch_ptr if FULL_SCRATCH else scratch_ptr + pid.to(tl.int64) * SLOT_ROWS * K1 * O1
    for tile in range(pid, tl.cdiv(B, BLOCK_M), nprog):
        offs_m = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = offs_m < B
        rows = offs_m if FULL_SCRATCH else tl.arange(0, BLOCK_M).to(tl.int64)
        for blk in range(0, K1):
            for o0 in range(0, O1, BLOCK_O):
                acc = _tile_matmul(
                    in_ptr, w1_ptr, offs_m, mask_m, blk, o0, C1, O1,
                    stride_in_m, stride_in_blk, stride_in_c,
                    stride_w1_blk, stride_w1_o, stride_w1_c,
                    BLOCK_M, BLOCK_O, BLOCK_C,
                )  # fmt: skip
                offs_o = o0 + tl.arange(0, BLOCK_O)
                flat = blk * stride_sw_blk + offs_o * stride_sw_o
                tl.store(
                    slot + flat[None, :].to(tl.int64) * SLOT_ROWS + rows[:, None],
                    acc.to(scratch_ptr.dtype.element_ty),
                    mask=mask_m[:, None] & (offs_o[None, :] < O1),
                )
        # Every thread's stage-A stores must be visible before any thread reads them permuted.
        # The barrier suffices for global memory within one program: on NVIDIA, bar.sync
        # orders the CTA's memory accesses; on AMD, all waves of a workgroup share a CU and
        # its L1 (Triton does not enable tgsplit), and LLVM's AMDGPU memory model adds no
        # wait for workgroup-scope release/acquire there (a cta-scope release compiles to
        # nothing beyond the s_barrier in the gfx942 assembly).
        tl.debug_barrier()
        for blk in range(0, K2):
            for o0 in range(0, O2, BLOCK_O):
                # Stage B's operand is the scratch seen through the permuted flat index.
                acc = _tile_matmul(
                    slot, w2_ptr, rows, mask_m, blk, o0, C2, O2,
                    1, stride_sr_blk * SLOT_ROWS, stride_sr_c * SLOT_ROWS,
                    stride_w2_blk, stride_w2_o, stride_w2_c,
                    BLOCK_M, BLOCK_O, BLOCK_C,
                )  # fmt: skip
                offs_o = o0 + tl.arange(0, BLOCK_O)
                out = out_ptr + offs_m[:, None] * stride_out_m + blk * stride_out_blk
                tl.store(
                    out + offs_o[None, :] * stride_out_o,
                    acc.to(out_ptr.dtype.element_ty),
                    mask=mask_m[:, None] & (offs_o[None, :] < O2),
                )
        # The next tile overwrites the slot: wait until every thread has read it.
        tl.debug_barrier()


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


@triton.jit
def _block_stage_wgrad_kernel(
    in_ptr,
    w_ptr,
    out_ptr,
    other_ptr,
    partial_ptr,
    B,
    NBLK,
    NOUT,
    NRED,
    ROWS_PER_SPLIT,
    stride_in_m,
    stride_in_blk,
    stride_in_c,
    stride_w_blk,
    stride_w_o,
    stride_w_c,
    stride_out_m,
    stride_out_blk,
    stride_out_o,
    stride_other_m,
    stride_other_blk,
    stride_other_o,
    stride_p_split,
    stride_p_blk,
    stride_p_c,
    stride_p_o,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TRANS_OUT: tl.constexpr = False,
):
    """A stage of the input gradient and a weight gradient from the same loads, for narrow
    blocks (``NOUT <= BLOCK_O``, ``NRED <= BLOCK_C``; the launcher prunes configs that do not
    cover them):

    * ``out[m, blk, o] = sum_c in[m, blk, c] * w[blk, o, c]``, as ``_block_matmul_kernel``;
    * ``partial[split, blk, c, o] = sum over the split's rows m of in[m, blk, c] *
      other[m, blk, o]``, as ``_block_wgrad_kernel``.

    In the backward, ``in`` is dY (then dF), ``w`` is w2 (then w1) transposed by its strides,
    and ``other`` is the forward's intermediate (then x), whose feature is the stage's output
    feature. Grid: (splits, NBLK). Each program keeps its block's weights resident, walks its
    rows in a fixed order and writes its own partial: deterministic, without atomics, and the
    gradient is read once for both products.
    """
    split = tl.program_id(0)
    blk = tl.program_id(1)
    offs_o = tl.arange(0, BLOCK_O)
    offs_c = tl.arange(0, BLOCK_C)
    mask_o = offs_o < NOUT
    mask_c = offs_c < NRED
    w = tl.load(
        w_ptr + blk * stride_w_blk + offs_c[:, None] * stride_w_c + offs_o[None, :] * stride_w_o,
        mask=mask_c[:, None] & mask_o[None, :],
        other=0.0,
    )  # (BLOCK_C, BLOCK_O): w[blk] transposed by its strides
    row0 = split * ROWS_PER_SPLIT
    row_end = tl.minimum(row0 + ROWS_PER_SPLIT, B)
    acc = tl.zeros((BLOCK_C, BLOCK_O), dtype=tl.float32)
    for m0 in range(row0, row_end, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = offs_m < row_end
        a = tl.load(
            in_ptr
            + offs_m[:, None] * stride_in_m
            + blk * stride_in_blk
            + offs_c[None, :] * stride_in_c,
            mask=mask_m[:, None] & mask_c[None, :],
            other=0.0,
        ).to(w.dtype)  # (BLOCK_M, BLOCK_C)
        if TRANS_OUT:  # batch-contiguous output: the tile transposed (_block_matmul_kernel)
            out = tl.dot(tl.trans(w), tl.trans(a), input_precision="ieee")
        else:
            out = tl.dot(a, w, input_precision="ieee")
        out_blk = out_ptr + blk * stride_out_blk
        _store_tile(
            out_blk, out, offs_m, offs_o, mask_m, mask_o, stride_out_m, stride_out_o, TRANS_OUT
        )
        g = tl.load(
            other_ptr
            + offs_m[:, None] * stride_other_m
            + blk * stride_other_blk
            + offs_o[None, :] * stride_other_o,
            mask=mask_m[:, None] & mask_o[None, :],
            other=0.0,
        ).to(w.dtype)  # (BLOCK_M, BLOCK_O)
        acc = tl.dot(tl.trans(a), g, acc, input_precision="ieee")
    p = partial_ptr + split * stride_p_split + blk * stride_p_blk
    tl.store(
        p + offs_c[:, None] * stride_p_c + offs_o[None, :] * stride_p_o,
        acc,
        mask=mask_c[:, None] & mask_o[None, :],
    )
