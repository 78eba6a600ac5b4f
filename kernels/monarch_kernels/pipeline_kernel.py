"""The pipelined forward (path ``pipelined``): the whole Monarch forward in one launch and one
pass over memory, each row tile's intermediates handed between programs through a ring of
scratch slots in the cache they all share. Launched by ``pipeline_launch._pipelined``.

Programs coordinate through counters in global memory: an atomic ticket hands out work items
in order, and per-tile counters say when a tile's stage is done. Triton compiles a scalar
atomic to one thread's operation whose result reaches the others through shared memory
between barriers, which is the usual semaphore pattern (on sm_90: ``bar.sync``, one
thread's ``red.release.gpu``; one thread's ``ld.relaxed.gpu`` polling, one
``ld.acquire.gpu``, then ``bar.sync``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _store_tile, _tile_matmul


@triton.jit
def _zero_kernel(ptr, N, BLOCK: tl.constexpr):
    """``ptr[:N] = 0``: the pipelined forward's counters, before each launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until ``*counter_ptr >= target``, then acquire: what the counter's producers wrote
    before their release is then visible to every thread of the program (Triton has one
    thread make each atomic and hands the value to the others through shared memory and a
    barrier).

    The polls are relaxed and the acquire comes once, after them: an acquire invalidates the
    compute unit's caches (on gfx942 a ``buffer_inv sc1`` each time), which a poll per
    microsecond from every waiting program would do for nothing. The acquire is an atomic
    read-modify-write, so it reads the newest count and synchronises with every release
    before it."""
    seen = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu")
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _signal(counter_ptr):
    """``*counter_ptr += 1`` once this program's stores are done: a barrier (every thread's
    stores issued before it), then one thread's release add."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _h_tile(h_ptr, t, B, RING, K1, O1, BLOCK_M: tl.constexpr, KEEP: tl.constexpr):
    """Where row tile t's intermediate lies, feature-major: (its first element, the leading
    dimension). A ring slot of BLOCK_M rows; with KEEP, the tile's rows of the whole
    ``(K1*O1, B)`` intermediate, which the caller keeps for the backward."""
    if KEEP:
        return h_ptr + (t * BLOCK_M).to(tl.int64), B
    else:
        return h_ptr + (t % RING).to(tl.int64) * (K1 * O1 * BLOCK_M), BLOCK_M


@triton.jit
def _monarch_pipeline_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    y_ptr,
    h_ptr,
    yb_ptr,
    sync_ptr,
    B,
    K1,
    O1,
    C1,
    C2,
    stride_x_m,
    stride_x_blk,
    stride_x_c,
    stride_w1_blk,
    stride_w1_o,
    stride_w1_c,
    stride_w2_blk,
    stride_w2_o,
    stride_w2_c,
    stride_y_m,
    LAG,
    RING,
    L: tl.constexpr,
    S: tl.constexpr,
    J1: tl.constexpr,
    J2: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_C: tl.constexpr,
    KEEP: tl.constexpr = False,
):
    """The whole forward in one launch, one pass over memory: each row tile's intermediates
    go through a ring of L2-sized scratch slots, handed between programs by counters (with
    KEEP, the stage-1 intermediate goes to the whole ``(K1*O1, B)`` buffer at ``h_ptr``
    instead, for the backward; it is read back while still in the cache).

    Work comes in items, taken in order from a ticket counter by persistent programs. Round m
    holds the stage-1 items of row tile m (``K1/J1``, J1 blocks each, into the tile's slot of
    ``h``, feature-major), the stage-2 items of tile ``m - LAG`` (``L/J2``, into the slot's
    block-major ``yb``) and the row-transpose items of tile ``m - 2*LAG`` (``PARTS``, from
    ``yb`` into y). An item waits for the counter of the items it reads (stage 2: the tile's
    stage 1; transposes: its stage 2; stage 1: the transposes of the tile that last used its
    slot, ``RING > 2*LAG`` tiles before) and counts itself done on its own counter. Every
    item waits only on items with earlier tickets, which programs already running hold, so
    the launch cannot deadlock however many of its programs the GPU runs at once; ``LAG``
    rounds between the stages let the awaited items finish before they are needed.

    ``sync_ptr`` (int32, zeroed before each launch): the ticket, then per row tile three
    counters: stage 1 done, stage 2 done, transposes done.
    """
    tiles = tl.cdiv(B, BLOCK_M)
    groups1 = K1 // J1
    groups2 = L // J2
    per_round = groups1 + groups2 + PARTS
    total = (tiles + 2 * LAG) * per_round
    loc = tl.arange(0, BLOCK_M).to(tl.int64)
    # the ticket only hands out work (relaxed: no cache invalidation per item); what an item
    # reads is ordered by the per-tile counters' release and acquire
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while ticket < total:
        rnd = ticket // per_round
        item = ticket - rnd * per_round
        if item < groups1:  # stage 1, blocks item*J1 .. of tile rnd
            t = rnd
            if t < tiles:
                if t >= RING:  # the slot's previous tile must be out of it
                    _wait_for(sync_ptr + 3 + 3 * (t - RING), PARTS)
                rows = t * BLOCK_M + loc
                mask_m = rows < B
                h_tile, ld = _h_tile(h_ptr, t, B, RING, K1, O1, BLOCK_M, KEEP)
                for jj in range(0, J1):
                    blk = item * J1 + jj
                    for o0 in range(0, O1, BLOCK_O):
                        acc = _tile_matmul(
                            x_ptr, w1_ptr, rows, mask_m, blk, o0, C1, O1,
                            stride_x_m, stride_x_blk, stride_x_c,
                            stride_w1_blk, stride_w1_o, stride_w1_c,
                            BLOCK_M, BLOCK_O, BLOCK_C, True,
                        )  # fmt: skip
                        offs_o = o0 + tl.arange(0, BLOCK_O)
                        _store_tile(
                            h_tile + blk * O1 * ld, acc, loc, offs_o, mask_m,
                            offs_o < O1, 1, ld, True,
                        )  # fmt: skip
                _signal(sync_ptr + 1 + 3 * t)
        elif item < groups1 + groups2:  # stage 2, blocks (item - groups1)*J2 .. of tile t
            t = rnd - LAG
            if (t >= 0) & (t < tiles):
                _wait_for(sync_ptr + 1 + 3 * t, groups1)
                mask_m = t * BLOCK_M + loc < B
                h_tile, ld = _h_tile(h_ptr, t, B, RING, K1, O1, BLOCK_M, KEEP)
                yb_slot = yb_ptr + (t % RING).to(tl.int64) * (BLOCK_M * L * S)
                for jj in range(0, J2):
                    blk = (item - groups1) * J2 + jj
                    for o0 in range(0, S, BLOCK_O):
                        # element rr of block j is the intermediate's rr*L + j
                        acc = _tile_matmul(
                            h_tile, w2_ptr, loc, mask_m, blk, o0, C2, S,
                            1, ld, L * ld,
                            stride_w2_blk, stride_w2_o, stride_w2_c,
                            BLOCK_M, BLOCK_O, BLOCK_C,
                        )  # fmt: skip
                        offs_o = o0 + tl.arange(0, BLOCK_O)
                        _store_tile(
                            yb_slot + blk * S, acc, loc, offs_o, mask_m, offs_o < S,
                            L * S, 1, False,
                        )  # fmt: skip
                _signal(sync_ptr + 2 + 3 * t)
        else:  # y[b, a*L + j] = yb[b, j*S + a] for part (item - groups1 - groups2) of tile t
            t = rnd - 2 * LAG
            if (t >= 0) & (t < tiles):
                _wait_for(sync_ptr + 2 + 3 * t, groups2)
                yb_slot = yb_ptr + (t % RING).to(tl.int64) * (BLOCK_M * L * S)
                part = item - groups1 - groups2
                for m0 in range(0, BLOCK_M // PARTS, BLOCK_T):
                    lm = part * (BLOCK_M // PARTS) + m0 + tl.arange(0, BLOCK_T).to(tl.int64)
                    m3 = lm[:, None, None]
                    rows3 = t * BLOCK_M + m3
                    for p0 in range(0, L, BLOCK_P):
                        for q0 in range(0, S, BLOCK_Q):
                            u3 = (p0 + tl.arange(0, BLOCK_P))[None, :, None]
                            v3 = (q0 + tl.arange(0, BLOCK_Q))[None, None, :]
                            mask = (rows3 < B) & (u3 < L) & (v3 < S)
                            tile = tl.load(yb_slot + m3 * (L * S) + u3 * S + v3, mask=mask)
                            tl.store(y_ptr + rows3 * stride_y_m + v3 * L + u3, tile, mask=mask)
                _signal(sync_ptr + 3 + 3 * t)
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
