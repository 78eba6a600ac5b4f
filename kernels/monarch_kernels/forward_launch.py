# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The forward's launchers: ``monarch_forward`` on every path, the chunked path's sizing and
the forward's path choice.

``monarch_forward`` takes 2-d activations ``(B, features)`` with any strides (the kernels take
strides, so non-contiguous inputs are never copied) and returns a fresh contiguous tensor.
``ops.py`` wraps it into the autograd-aware custom op.
"""

from __future__ import annotations

import torch
import triton

from . import blas, replay
from . import triton_launch as launch
from .configs import get_configs
from .path_choice import _choose
from .pipeline_launch import _pipelined
from .triton_launch import (
    _batch_last,
    _cdiv,
    _check,
    _fused,
    _path,
    _shapes,
    _signature,
    _stage,
    _transpose_rows,
)

CACHE_SHARE = 4  # the chunked path's scratch: a quarter of the shared cache (_cache_bytes) each
MAX_CHUNKS = 16  # and at most this many chunks (three launches each)


def monarch_forward(
    x2: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    path: str | None = None,
    configs: dict[str, triton.Config] | None = None,
    num_programs: int | None = None,
    keep: bool = False,
    chunk_rows: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(B, n) -> (B, s*l)``; with ``keep``, ``(y, h)``, h the feature-major intermediate
    (k*q, B) for the backward. ``path``: one of PATHS, or None (chosen here); ``keep`` never
    takes the fused path, which holds no whole intermediate. ``chunk_rows``: the chunked
    path's rows per chunk (by default from the shared cache's size). A call like one seen
    before repeats its launches from a plan (``replay.py``)."""

    def launcher():
        return _forward(x2, w1, w2, path, configs, num_programs, keep, chunk_rows)

    interp = launch.interpreting()
    if configs or num_programs or chunk_rows or not replay.enabled(interp):
        return launcher()
    key = ("forward", _path(path), keep, launch.GROUPED, interp, *_signature(x2, w1, w2))
    return replay.call(key, (x2, w1, w2), launcher)


def _forward(x2, w1, w2, path, configs, num_programs, keep, chunk_rows):
    _check(x=x2, w1=w1, w2=w2)
    k, q, p, l, s, r = _shapes(x2, w1, w2)
    configs = configs or {}
    path = _path(path)
    if path is None or (keep and path == "fused"):
        path = _choose_forward_path(x2, w1, w2, l)
    B = x2.shape[0]
    y = x2.new_empty(B, s * l)
    sx = (x2.stride(0), p * x2.stride(1), x2.stride(1))  # x[b, i*p + c]
    sw1 = (w1.stride(0), w1.stride(1), w1.stride(2))
    sw2 = (w2.stride(0), w2.stride(1), w2.stride(2))
    sy = (y.stride(0), y.stride(1), l * y.stride(1))  # y[b, a*l + j]
    if path == "fused":
        sms = launch._sm_count(x2.device)
        fused_cfg = configs.get("fused")
        slot_rows = (
            fused_cfg.kwargs["BLOCK_M"]
            if fused_cfg
            else max(c.kwargs["BLOCK_M"] for c in get_configs("fused"))
        )
        nprog = min(num_programs or 2 * sms, _cdiv(B, 16))  # 16: the smallest BLOCK_M
        scratch = x2.new_empty(nprog * slot_rows * k * q)
        sizes = (B, k, q, p, l, s, r)
        # Stage 1 writes flat index i*q + a; stage 2 reads element rr of block j at rr*l + j.
        strides = (*sx, *sw1, *sw2, *sy, q, 1, 1, l)
        _fused(x2, w1, w2, y, scratch, sizes, slot_rows, strides, nprog, False, fused_cfg)
        return y
    if path == "pipelined":
        # as many programs as fit at once: its configs compile to about 250 registers a
        # thread at 4 warps (sm_90 cubin), two programs an SM, as the stage kernels do
        nprog = num_programs or 2 * launch._sm_count(x2.device)
        h = _pipelined(x2, w1, w2, y, (sx, sw1, sw2), nprog, configs.get("pipeline"), keep)
        return (y, h) if keep else y
    if path in ("three_kernel", "chunked"):
        rows = B
        if path == "chunked":
            rows = chunk_rows or _default_chunk_rows(x2, w1, w2)
        h = _three_kernel_forward(x2, w1, w2, y, max(1, rows), keep, configs)
    elif path == "blas":
        ht, yt = blas.forward_stages(x2, w1, w2)
        _batch_last(y, yt, l, s, to_flat=True)
        h = ht.view(k * q, B)
    else:
        h = x2.new_empty(k * q, B)  # feature-major intermediate, row tiles contiguous
        _stage(x2, w1, h, B, k, q, p, sx, sw1, (1, q * B, B), configs)
        _stage(h, w2, y, B, l, s, r, (1, B, l * B), sw2, sy, configs)
    return (y, h) if keep else y


def _chunk_rows(B: int, row_bytes: int, device: torch.device) -> int:
    """Rows per chunk of the chunked path: as many as keep each intermediate's chunk within
    ``1/CACHE_SHARE`` of the shared cache (``_cache_bytes``), in a multiple of 128 rows, which
    row tiles divide (of 16 for small chunks), but no more than ``MAX_CHUNKS`` chunks.
    Multiples of 16 rows start every chunk 16-byte aligned in the feature-major
    intermediate."""
    fit = launch._cache_bytes(device) // CACHE_SHARE // row_bytes
    fit = fit // 128 * 128 if fit >= 256 else max(16, fit // 16 * 16)
    return max(fit, _cdiv(_cdiv(B, MAX_CHUNKS), 16) * 16)


def _three_kernel_forward(x2, w1, w2, y, rows, keep, configs) -> torch.Tensor | None:
    """The three-kernel chain over chunks of ``rows`` rows (one chunk: ``three_kernel``;
    several: ``chunked``), into ``y``; returns the whole intermediate with ``keep``.

    Stage 1 writes the feature-major intermediate, stage 2 a block-major ``yb[b, j*s + a]``
    (coalesced along a), and a row transpose moves that into y. Each chunk's intermediates
    are written by one kernel and read by the next while still in the shared cache, and the
    scratch they live in is reused by the next chunk, so their lines are overwritten there
    rather than written back: memory sees x read and y written (and, with ``keep``, h
    written), where the unchunked chain moves every intermediate both ways.
    """
    k, q, p = w1.shape
    l, s, r = w2.shape
    B = x2.shape[0]
    h = x2.new_empty(k * q, B if keep else min(rows, B))
    permuted = l > 1 and s > 1  # else stage 2 writes y directly, in its own order
    yb = x2.new_empty(min(rows, B), l * s) if permuted else None
    sw1 = (w1.stride(0), w1.stride(1), w1.stride(2))
    sw2 = (w2.stride(0), w2.stride(1), w2.stride(2))
    for c0 in range(0, B, rows):
        n = min(rows, B - c0)
        xc, yc = x2[c0 : c0 + n], y[c0 : c0 + n]
        hc = h[:, c0 : c0 + n] if keep else h[:, :n]
        ld = hc.stride(0)
        sx = (xc.stride(0), p * xc.stride(1), xc.stride(1))
        _stage(xc, w1, hc, n, k, q, p, sx, sw1, (1, q * ld, ld), configs)
        if permuted:
            _stage(hc, w2, yb[:n], n, l, s, r, (1, ld, l * ld), sw2, (l * s, s, 1), configs)
            _transpose_rows(yb[:n], l, s, out=yc)
        else:
            sy = (yc.stride(0), yc.stride(1), l * yc.stride(1))
            _stage(hc, w2, yc, n, l, s, r, (1, ld, l * ld), sw2, sy, configs)
    return h if keep else None


def _choose_forward_path(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, l: int) -> str:
    if launch.interpreting():
        return "two_kernel"  # nothing to time

    def runs() -> dict:
        # fewest launches first (see _choose); with one output block there is no output
        # permutation: three_kernel is two_kernel
        paths = ("two_kernel", "blas") if l == 1 else ("two_kernel", "blas", "three_kernel")
        if _chunked_pays(x2, w1, w2):
            paths += ("chunked",)  # more launches than any: listed last
        return {p: (lambda p=p: monarch_forward(x2, w1, w2, path=p)) for p in paths}

    return _choose("forward", (x2, w1, w2), runs, "three_kernel")


def _chunked_pays(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the chunked path would make more than one chunk (else it is three_kernel)."""
    return x2.shape[0] > _default_chunk_rows(x2, w1, w2)


def _default_chunk_rows(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> int:
    """The chunked path's rows per chunk for these operands: sized by the wider of the two
    intermediates' rows."""
    (k, q, _p), (l, s, _r) = w1.shape, w2.shape
    return _chunk_rows(x2.shape[0], max(k * q, l * s) * x2.element_size(), x2.device)
