# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The backward's launchers: ``monarch_backward`` on every path (the input gradient and both
weight gradients, reduced deterministically in split partials) and the backward's path
choice.

``monarch_backward`` takes 2-d activations and gradients with any strides and returns fresh
contiguous tensors. ``ops.py`` registers it as the custom op's backward.
"""

from __future__ import annotations

import torch
import triton

from . import blas, replay
from . import triton_launch as launch
from .configs import get_configs
from .forward_launch import _chunked_pays, _default_chunk_rows
from .path_choice import _choose
from .triton_kernels import _sum_splits_kernel
from .triton_launch import (
    _batch_last,
    _cdiv,
    _check,
    _covers,
    _fused,
    _path,
    _run,
    _shapes,
    _signature,
    _stage,
    _transpose_rows,
)

_fitting: dict[tuple, list] = {}  # (the backend's stage_wgrad configs, blocks) -> those that fit


def _choose_backward_path(dy2, x2, w1, w2, h) -> str:
    if launch.interpreting():
        return "two_kernel"

    def runs() -> dict:
        # three_kernel differs from two_kernel only where the weight gradients can fuse
        (_k, q, p), (_l, s, r) = w1.shape, w2.shape
        fusable = bool(_stage_wgrad_configs(None, (r, s), (p, q)))
        paths = ("two_kernel", "blas", "three_kernel") if fusable else ("two_kernel", "blas")
        if _chunked_pays(x2, w1, w2):
            paths += ("chunked",)  # more launches than any: listed last
        return {
            path: (lambda path=path: monarch_backward(dy2, x2, w1, w2, path=path, h=h))
            for path in paths
        }

    return _choose("backward", (dy2, x2, w1, w2), runs, "two_kernel")


class _Partials:
    """Both weight gradients' split partials in one float32 buffer, ``(splits, *w1.shape)`` and
    ``(splits, *w2.shape)`` side by side, so that one launch sums and casts both (a sum and a
    cast for each took four)."""

    def __init__(self, splits: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        self.shapes = (w1.shape, w2.shape)
        self.n1 = w1.numel()
        self.buf = torch.empty(splits, self.n1 + w2.numel(), device=w1.device, dtype=torch.float32)
        self.dw1 = self.buf[:, : self.n1].view(splits, *w1.shape)
        self.dw2 = self.buf[:, self.n1 :].view(splits, *w2.shape)

    def split_range(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Splits ``start`` to ``stop`` of both partials (one chunk's)."""
        return self.dw1[start:stop], self.dw2[start:stop]

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dw1, dw2)``: the partials summed in split order (deterministic), in ``dtype``,
        as two tensors of their own (custom ops may not return aliases of one another)."""
        dw1 = self.buf.new_empty(self.shapes[0], dtype=dtype)
        dw2 = self.buf.new_empty(self.shapes[1], dtype=dtype)
        splits, n = self.buf.shape
        block = 1024
        args = (self.buf, dw1, dw2, self.n1, n, splits, self.buf.stride(0))
        _run(_sum_splits_kernel, (_cdiv(n, block),), args, BLOCK=block)
        return dw1, dw2


def _rows_per_split(B: int, splits: int) -> int:
    """Rows each split reduces: a multiple of 64, so that every split starts on a 64-row
    boundary. Triton then knows the first row's alignment and loads and stores along a
    batch-contiguous operand (the feature-major intermediates) as vectors; from an
    unaligned start it moves them one element at a time. Trailing splits may get no rows."""
    return _cdiv(_cdiv(B, splits), 64) * 64


def _wgrad(a, b, partial, nblk, o, c, B, s_a, s_b, config) -> None:
    """``partial[split] = sum over the split's rows of a[m, blk, :] outer b[m, blk, :]``, for
    ``partial`` (splits, nblk, o, c)."""
    splits = partial.shape[0]
    rows_per_split = _rows_per_split(B, splits)

    def grid(meta):
        tiles = _cdiv(o, meta["BLOCK_O"]) * _cdiv(c, meta["BLOCK_C"])
        return (splits, nblk, tiles)

    args = (a, b, partial, B, nblk, o, c, rows_per_split, *s_a, *s_b, *partial.stride())
    launch._launch("wgrad", grid, args, config)


def _stage_wgrad_configs(config, *blocks: tuple[int, int]) -> list:
    """The stage_wgrad configs (``config`` or the backend's) whose tile holds every
    ``(nout, nred)`` block given; empty where the blocks are too wide to fuse."""
    if config:
        return [config] if all(_covers(config, o, r) for o, r in blocks) else []
    candidates = get_configs("stage_wgrad")  # kept by configs.py: one list per override
    key = (id(candidates), blocks)
    if key not in _fitting:
        _fitting[key] = [c for c in candidates if all(_covers(c, o, r) for o, r in blocks)]
    return _fitting[key]


def _stage_wgrad(inp, w, out, other, partial, sizes, strides, config) -> None:
    """``out = stage(inp, w)`` and, from the same loads, ``partial[split] = sum over the
    split's rows of inp outer other``, for ``partial`` (splits, nblk, c, o)."""
    B, nblk, o, c = sizes
    splits = partial.shape[0]
    args = (inp, w, out, other, partial, B, nblk, o, c, _rows_per_split(B, splits))
    args += (*strides, *partial.stride())
    # strides: in, w, out, other, 3 each; a batch-contiguous output is computed transposed
    trans = strides[6] == 1
    launch._launch("stage_wgrad", lambda meta: (splits, nblk), args, config, TRANS_OUT=trans)


def monarch_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    path: str | None = None,
    configs: dict[str, triton.Config] | None = None,
    num_programs: int | None = None,
    splits: int | None = None,
    h: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dw1, dw2)`` for ``y = monarch(x, w1, w2)`` given ``dy``; ``h``, the
    forward's feature-major intermediate (k*q, B), spares recomputing it. ``path``: one of
    PATHS, or None (chosen here); ``chunk_rows`` as for ``monarch_forward`` (``splits`` is
    then per chunk). A call like one seen before repeats its launches from a plan
    (``replay.py``)."""

    def launcher():
        return _backward(dy2, x2, w1, w2, path, configs, num_programs, splits, h, chunk_rows)

    interp = launch.interpreting()
    if configs or num_programs or splits or chunk_rows or not replay.enabled(interp):
        return launcher()
    key = ("backward", _path(path), launch.GROUPED, interp, *_signature(dy2, x2, w1, w2, h))
    inputs = (dy2, x2, w1, w2) if h is None else (dy2, x2, w1, w2, h)
    return replay.call(key, inputs, launcher)


def _backward(dy2, x2, w1, w2, path, configs, num_programs, splits, h, chunk_rows):
    _check(dy=dy2, x=x2, w1=w1, w2=w2)
    k, q, p, l, s, r = _shapes(x2, w1, w2)
    B = x2.shape[0]
    if tuple(dy2.shape) != (B, s * l):
        raise ValueError(
            f"monarch triton: grad has shape {tuple(dy2.shape)}, expected ({B}, {s * l})"
        )
    if h is not None and h.stride() != (B, 1):
        h = None  # not the forward's feature-major intermediate: recompute it
    path = _path(path) or _choose_backward_path(dy2, x2, w1, w2, h)
    if path == "pipelined":
        path = "chunked"  # its backward: the Triton chain over chunks of rows
    configs = configs or {}
    # the weight gradients fold into the stages where a tile holds a whole block
    fitting = _stage_wgrad_configs(configs.get("stage_wgrad"), (r, s), (p, q))
    fuse = path in ("two_kernel", "chunked") and bool(fitting)
    rows = B
    if path == "chunked":
        rows = min(chunk_rows or _default_chunk_rows(x2, w1, w2), B)
    if splits is None:
        # Enough programs for about eight per SM (each reduction is a long, latency-bound
        # loop), but at least 256 rows of reduction each (in each chunk).
        tiles = 1 if fuse else max(1, (q // 64) * (p // 64))
        sms = launch._sm_count(x2.device)
        splits = max(1, min(_cdiv(8 * sms, max(k, l) * tiles), _cdiv(rows, 256)))
    if path == "blas":
        vendor = vendor_weight_grads(x2.device)
        return _blas_backward(dy2, x2, w1, w2, h, splits, configs.get("wgrad"), vendor)
    chunks = _cdiv(B, rows) if rows else 1
    partials = _Partials(chunks * splits, w1, w2)
    dx = x2.new_empty(B, k * p)
    # scratch for one chunk's rows (all of them, unchunked): dY in block-major order (none
    # where there is no permutation to undo), dF, and h where the forward kept none
    dyb = x2.new_empty(rows, l * s) if l > 1 and s > 1 else None
    df = x2.new_empty(k * q, rows)
    hbuf = x2.new_empty(k * q, rows) if h is None else None
    if fuse:
        config = configs.get("stage_wgrad") or (fitting[0] if launch.interpreting() else None)
        how = ("fuse", config)
    elif path == "fused":
        how = ("fused", num_programs or 4 * launch._sm_count(x2.device))
    else:
        how = ("apart", None)
    for c in range(chunks):
        c0, c1 = c * rows, min(B, (c + 1) * rows)
        _backward_rows(
            dy2[c0:c1], x2[c0:c1], None if h is None else h[:, c0:c1], dx[c0:c1],
            (dyb, df, hbuf), partials.split_range(c * splits, (c + 1) * splits),
            w1, w2, how, configs,
        )  # fmt: skip
    return dx, *partials.finish(w1.dtype)


def _backward_rows(dy, x, h, dx, scratch, partials, w1, w2, how, configs) -> None:
    """The Triton backward of one range of rows: ``dx`` written, the weight gradients' split
    partials into ``partials`` (dw1's, dw2's). ``scratch`` holds buffers for at least these
    rows: dY block-major (None where l or s is 1), dF and h (used where ``h`` is None).
    ``how``: ("fuse", config) computes each weight gradient in the stage that reads the same
    gradient; ("fused", programs) the input gradient in one fused launch; ("apart", None)
    the stages, then the weight-gradient kernels."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    B = x.shape[0]
    dyb, df, hbuf = scratch
    pdw1, pdw2 = partials
    sx = (x.stride(0), p * x.stride(1), x.stride(1))
    # dY[b, j, a] = dy[b, a*l + j]: put into block-major order once, for the readers that
    # follow (no permutation to undo when l or s is 1)
    if dyb is not None:
        dy, sdy = _transpose_rows(dy, s, l, out=dyb[:B]), (l * s, s, 1)
    else:
        sdy = (dy.stride(0), dy.stride(1), l * dy.stride(1))
    # The input gradient is the transposed Monarch product: w2[j].T, then (l r) -> (r l), then
    # w1[i].T. dF, the gradient of the flat intermediate, is kept feature-major for dw1.
    sw2t = (w2.stride(0), w2.stride(2), w2.stride(1))
    sw1t = (w1.stride(0), w1.stride(2), w1.stride(1))
    df = df[:, :B]
    ld = df.stride(0)
    sdx = (dx.stride(0), p, 1)
    if h is None:  # stage 1 again, where the forward kept nothing
        h = hbuf[:, :B]
        sw1 = (w1.stride(0), w1.stride(1), w1.stride(2))
        _stage(x, w1, h, B, k, q, p, sx, sw1, (1, q * h.stride(0), h.stride(0)), configs)
    lh = h.stride(0)
    mode, arg = how
    if mode == "fuse":
        # dF = dY w2[j] (intermediate order) with dw2[j] = dY[j].T G[j], G[b, j, rr] =
        # h[rr*l + j, b]; then dx = dF w1[i] with dw1[i] = dF[i].T x[i]
        strides = (*sdy, *sw2t, 1, ld, l * ld, 1, lh, l * lh)
        _stage_wgrad(dy, w2, df, h, pdw2, (B, l, r, s), strides, arg)
        strides = (1, q * ld, ld, *sw1t, *sdx, *sx)
        _stage_wgrad(df, w1, dx, x, pdw1, (B, k, p, q), strides, arg)
        return
    if mode == "fused":
        sizes = (B, l, r, s, k, p, q)
        # Stage A writes element rr of block j at rr*l + j; stage B reads i*q + a.
        strides = (*sdy, *sw2t, *sw1t, *sdx, 1, l, q, 1)
        _fused(dy, w2, w1, dx, df, sizes, ld, strides, arg, True, configs.get("fused"))
    else:
        _stage(dy, w2, df, B, l, r, s, sdy, sw2t, (1, ld, l * ld), configs)
        _stage(df, w1, dx, B, k, p, q, (1, q * ld, ld), sw1t, sdx, configs)
    cfg = configs.get("wgrad")
    _wgrad(df, x, pdw1, k, q, p, B, (1, q * ld, ld), sx, cfg)
    # dw2[j] = dY[j].T @ G[j], with G[b, j, rr] = h[rr*l + j, b]
    _wgrad(dy, h, pdw2, l, s, r, B, sdy, (1, lh, l * lh), cfg)


def vendor_weight_grads(device: torch.device) -> bool:
    """Whether the ``blas`` backward takes its weight gradients from the vendor GEMM too.

    On CUDA, yes: cuBLAS GEMMs give bitwise identical results run to run on one GPU model
    (its documentation's reproducibility guarantee; no atomics) and run wide blocks about
    twice as fast as the split-reduction kernel. On ROCm builds of torch (whose GEMMs are
    rocBLAS's and hipBLASLt's), no: rocBLAS allows atomics by default. Nor under
    ``torch.use_deterministic_algorithms(True)``, where torch refuses cuBLAS GEMMs unless
    ``CUBLAS_WORKSPACE_CONFIG`` is set; the split-reduction kernel needs neither.
    """
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and not torch.are_deterministic_algorithms_enabled()
    )


def _blas_backward(dy2, x2, w1, w2, h, splits, wgrad_config, vendor_wgrad=False):
    """The backward on the vendor BLAS: dy put batch-last once (one Triton pass), the input
    gradient's two GEMMs writing the permuted layouts through strided views, and the weight
    gradients on the vendor GEMM (``vendor_wgrad``) or on the deterministic split-reduction
    kernel."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    B = x2.shape[0]
    dyt = dy2.new_empty(l, s, B)
    _batch_last(dy2, dyt, l, s, to_flat=False)
    dht, dx = blas.input_grads(dyt, w1, w2, strided_out=True)
    h = blas.stage_one(x2, w1).view(k * q, B) if h is None else h
    if vendor_wgrad:
        return dx, *blas.weight_grads(dyt, dht, x2, h.view(k, q, B), l)
    sx = (x2.stride(0), p * x2.stride(1), x2.stride(1))
    partials = _Partials(splits, w1, w2)
    _wgrad(dht, x2, partials.dw1, k, q, p, B, (1, q * B, B), sx, wgrad_config)
    # dw2[j] = dY[j].T @ G[j], with G[b, j, rr] = h[rr*l + j, b]
    sdy = (1, s * B, B)
    _wgrad(dyt, h, partials.dw2, l, s, r, B, sdy, (1, B, l * B), wgrad_config)
    return dx, *partials.finish(w1.dtype)
