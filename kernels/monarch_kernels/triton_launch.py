# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The Triton launchers: ``monarch_forward`` and ``monarch_backward`` on the two paths that
won on an H200, and the timed choice between them.

* ``three_kernel``: stage 1 writes the feature-major intermediate ``h`` (k*q, B), stage 2 a
  block-major ``yb[b, j*s + a]`` (coalesced along a), and a row transpose puts that into y's
  order. The backward runs the transposed product the same way, then the weight gradients in
  split partials (deterministic: no atomics), summed by one launch.
* ``blas``: the block products on the vendor BLAS (``blas.py``), with the permutation between
  the stages as a leading dimension, then one Triton pass for the output permutation.

Without a forced path (``MONARCH_KERNELS_PATH``) each direction times both once per shape and
batch-size bucket (the next power of two) and keeps the faster. Both launchers take 2-d
activations ``(B, features)`` with any strides (the kernels take strides, so non-contiguous
inputs are never copied) and return fresh contiguous tensors; ``ops.py`` wraps them into the
autograd-aware custom ops.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings

import torch
import triton

from . import blas
from .configs import get_configs, prune
from .reference import monarch_shapes
from .triton_kernels import (
    _batch_last_kernel,
    _block_matmul_kernel,
    _block_wgrad_kernel,
    _sum_splits_kernel,
    _transpose_rows_kernel,
)

try:  # what a kernel that does not build or launch raises (ptxas's errors too, on Triton 3.2+)
    from triton.errors import TritonError as _BuildError
except ImportError:
    _BuildError = triton.CompilationError

PATH_ENV_VAR = "MONARCH_KERNELS_PATH"  # forces one of PATHS
PATHS = ("three_kernel", "blas")
# Compiler options of every launch. FMA contraction stays on as Triton has always defaulted;
# said explicitly, the kernels compile the same on Triton 3.10 (whose default turns it off)
# and Triton 3.9 does not warn each process about the coming change.
_OPTIONS = {"enable_fp_fusion": True}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCKS = 65535  # grid axis 1 carries the block index
MAX_ELEMENTS = 2**31 - 1  # row/feature offsets are computed in int32 before widening
_KEYS = {
    # the strides that say which side is permuted: stage 1 and stage 2 have the same sizes in
    # the square case but very different memory access
    "stage": ["B", "NBLK", "NOUT", "NRED", "stride_in_m", "stride_out_blk"],
    "wgrad": ["B", "NBLK", "NOUT", "NRED"],
}
_KERNELS = {"stage": _block_matmul_kernel, "wgrad": _block_wgrad_kernel}
_autotuned: dict[str, object] = {}  # kind -> Triton's autotuner over the backend's configs
_tuned: dict[tuple, triton.Config] = {}  # (kind, autotuning key) -> the config it chose
_key_positions: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
_path_choice: dict[tuple, str] = {}  # (direction, batch bucket, shapes, dtype, ...) -> path


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv goes through Triton's JIT-function call: ~1.5 us a call


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()  # triton.next_power_of_2, for n >= 1


def batch_bucket(rows: int) -> int:
    """The batch size that tuning and the path choice key on: the next power of two, so that
    a new batch size within a bucket reuses what an earlier one measured."""
    return _pow2(rows)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _path(path: str | None) -> str | None:
    path = path or os.environ.get(PATH_ENV_VAR) or None
    if path is not None and path not in PATHS:
        raise ValueError(f"monarch triton: path must be one of {PATHS}, got {path!r}")
    return path


def _check(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"monarch triton: {name} has dtype {t.dtype}; the kernels take float16, "
                "bfloat16 or float32"
            )
        if t.dtype != first.dtype:
            raise TypeError(f"monarch triton: mixed dtypes {first.dtype} and {t.dtype} ({name})")
        if t.device != first.device:
            raise ValueError(
                f"monarch triton: {name} is on {t.device}, expected {first.device} like the others"
            )
        if t.numel() > MAX_ELEMENTS:
            raise ValueError(
                f"monarch triton: {name} has {t.numel()} elements; the kernels index at most "
                f"2**31 - 1 per tensor"
            )
    if first.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"monarch triton: tensors are on {first.device}; the kernels need a GPU "
            "(or TRITON_INTERPRET=1)"
        )


def _shapes(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[int, ...]:
    if x2.dim() != 2:
        raise ValueError(f"monarch triton: activations must be 2-d (B, n), got {tuple(x2.shape)}")
    k, q, p, l, s, r = monarch_shapes(x2.shape[1], w1, w2)
    if max(k, l) > MAX_BLOCKS:
        raise ValueError(
            f"monarch triton: {max(k, l)} blocks; the grid allows at most {MAX_BLOCKS} per factor"
        )
    if k * q * x2.shape[0] > MAX_ELEMENTS:
        raise ValueError(
            f"monarch triton: the intermediate has {k * q * x2.shape[0]} elements "
            f"(k*q={k * q} x batch {x2.shape[0]}); the kernels index at most 2**31 - 1"
        )
    return k, q, p, l, s, r


def _batch_last(flat: torch.Tensor, blk: torch.Tensor, l: int, s: int, *, to_flat: bool) -> None:
    """Copy between ``flat`` (B, s*l), batch-first, and ``blk`` (l, s, B), batch-last:
    ``flat[b, a*l + j] = blk[j, a, b]``, in the direction ``to_flat`` says."""
    B = flat.shape[0]
    grid = (_cdiv(B, 64), _cdiv(s * l, 64))
    args = (flat, blk, B, s, l, *flat.stride(), *blk.stride())
    _run(_batch_last_kernel, grid, args, TO_FLAT=to_flat, BLOCK_M=64, BLOCK_O=64)


def _transpose_rows(
    t: torch.Tensor, P: int, Q: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row of ``t`` (B, P*Q), read as P x Q, transposed: a contiguous (B, Q*P), or
    written into ``out`` (B, Q*P) with unit feature stride."""
    B = t.shape[0]
    if out is None:
        out = t.new_empty(B, Q * P)
    if t.stride(1) != 1:
        t = t.contiguous()
    bp = min(64, _pow2(P))
    bq = min(64, _pow2(Q))
    bm = max(1, 8192 // (bp * bq))
    grid = (_cdiv(B, bm), _cdiv(P, bp), _cdiv(Q, bq))
    args = (t, out, B, t.stride(0), out.stride(0))
    _run(_transpose_rows_kernel, grid, args, P=P, Q=Q, BLOCK_M=bm, BLOCK_P=bp, BLOCK_Q=bq)
    return out


def _launch(kind: str, grid, args: tuple, config: triton.Config | None, **const) -> None:
    """Launch ``kind`` with ``config``, else autotuned over the backend's configs.

    Autotuning runs through Triton's autotuner the first time a key is seen (the batch size
    in it bucketed); after that the config it chose is launched directly, which spares every
    call the autotuner's own bookkeeping and a new batch size in the bucket its re-tuning."""
    if config is None and interpreting():
        config = get_configs(kind)[0]  # the interpreter cannot time configs
    if config is None:
        key = _tuning_key(kind, args, const)
        config = _tuned.get(key)
        if config is None:
            tuner = _autotuner(kind)
            tuner[grid](*args, **const, **_OPTIONS)
            if getattr(tuner, "best_config", None) is not None:
                _tuned[key] = tuner.best_config
            return
    _run(_KERNELS[kind], grid(config.kwargs), args, **const, **config.all_kwargs())


def _run(kernel, grid: tuple[int, ...], args: tuple, **constants) -> None:
    """``kernel[grid](*args, **constants)`` with the compiler options of every launch."""
    kernel[grid](*args, **constants, **_OPTIONS)


def _autotuner(kind: str):
    """Triton's autotuner over ``kind``'s configs, those that only pad pruned per launch. Its
    choices are kept in Triton's cache on disk where this Triton can (3.2 and later): the next
    process (a new worker, a restarted kernel) compiles nothing and times nothing again."""
    if kind not in _autotuned:
        options = {"prune_configs_by": {"early_config_prune": prune}}
        if "cache_results" in inspect.signature(triton.autotune).parameters:
            options["cache_results"] = True
        tune = triton.autotune(configs=get_configs(kind), key=_KEYS[kind], **options)
        _autotuned[kind] = tune(_KERNELS[kind])
    return _autotuned[kind]


def _tuning_key(kind: str, args: tuple, const: dict) -> tuple:
    """What Triton's autotuner keys ``kind`` on (the ``_KEYS`` arguments, B bucketed, and the
    tensors' dtypes), plus the constants, read from the positional ``args`` (a kind's launcher
    always passes tensors at the same positions)."""
    if kind not in _key_positions:
        names = _KERNELS[kind].arg_names[: len(args)]
        keys = tuple(names.index(k) for k in _KEYS[kind] if k in names)
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        _key_positions[kind] = keys, tensors, names.index("B")
    keys, tensors, batch = _key_positions[kind]
    return (
        kind,
        *[batch_bucket(args[i]) if i == batch else args[i] for i in keys],
        *[args[i].dtype for i in tensors],
        *const.items(),
    )


def _sm_count(device: torch.device) -> int:
    """SMs (CUs on AMD) of ``device``; a small stand-in under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _stage(inp, w, out, B, nblk, o, c, s_in, s_w, s_out, config) -> None:
    """One block-diagonal stage; ``s_in``/``s_out`` are (row, block, feature) strides."""

    def grid(meta):
        return (_cdiv(B, meta["BLOCK_M"]) * _cdiv(o, meta["BLOCK_O"]) * nblk,)

    args = (inp, w, out, B, nblk, o, c, *s_in, *s_w, *s_out)
    # a batch-contiguous output (the feature-major intermediates) is computed transposed
    _launch("stage", grid, args, config, TRANS_OUT=s_out[0] == 1)


def _choose(direction: str, x2: torch.Tensor, operands: tuple, make_runs) -> str:
    """The faster of the paths ``make_runs()`` gives, for this direction, the weights' shapes
    and the batch's bucket, timed once and kept.

    Which path wins depends on the chip and the shape (on the H200: ``three_kernel`` at 64
    blocks of 64, ``blas`` at 4 blocks of 1024), so, like Triton's autotuner, the choice is
    timed on first use. Inside a CUDA-graph capture nothing can be timed, so a shape first
    seen there takes ``three_kernel``.
    """
    key = (
        direction,
        batch_bucket(x2.shape[0]),
        *(None if t is None else (tuple(t.shape), t.dtype) for t in operands),
        x2.dtype,
        x2.device,
    )
    if key not in _path_choice:
        if interpreting() or torch.cuda.is_current_stream_capturing():
            return "three_kernel"  # nothing to time
        runs = {p: run for p, run in make_runs().items() if _runs_here(p, run)}
        if not runs:
            raise RuntimeError(
                f"monarch_kernels: no {direction} path runs on this device (warnings above say "
                f"why); set {PATH_ENV_VAR}=<path> to see the error of one"
            )
        # alternate rounds, fastest of each: a clock still ramping up, or another process,
        # must not decide it
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(5):
            for p, run in runs.items():
                best[p] = min(best[p], _call_ms(run))
        _path_choice[key] = min(best, key=best.__getitem__)
    return _path_choice[key]


def chosen_paths() -> dict[tuple, str]:
    """The path each direction chose so far, by (direction, batch bucket, (shape, dtype) of
    each weight and of h, dtype, device)."""
    return dict(_path_choice)


def _call_ms(run, calls: int = 8) -> float:
    """Milliseconds per call of ``run`` called back to back, as a training loop calls it: the
    device's time where it is the slower, the host's (Python and launches) where that is."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def _runs_here(path: str, run) -> bool:
    """Run ``path`` once (autotuning and compilation stay out of the comparison); False, with a
    warning, if it fails. A config that does not build on an untried chip (too much shared
    memory, say) then costs speed, not the user's run."""
    try:
        run()
    except (_BuildError, triton.OutOfResources, RuntimeError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        warnings.warn(
            f"monarch_kernels: the {path} path failed here and is left out of the choice: "
            f"{type(err).__name__}: {first_line}",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def monarch_forward(
    x2: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    path: str | None = None,
    configs: dict[str, triton.Config] | None = None,
    keep: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(B, n) -> (B, s*l)``; with ``keep``, ``(y, h)``, h the feature-major intermediate
    (k*q, B) for the backward. ``path``: one of PATHS, or None (chosen here); ``configs``:
    a config per kernel kind, instead of autotuning (tests, ``tune.py``)."""
    _check(x=x2, w1=w1, w2=w2)
    k, q, p, l, s, r = _shapes(x2, w1, w2)
    configs = configs or {}

    def runs() -> dict:
        return {name: (lambda name=name: monarch_forward(x2, w1, w2, path=name)) for name in PATHS}

    path = _path(path) or _choose("forward", x2, (w1, w2), runs)
    B = x2.shape[0]
    y = x2.new_empty(B, s * l)
    if path == "blas":
        ht, yt = blas.forward_stages(x2, w1, w2)
        _batch_last(y, yt, l, s, to_flat=True)
        h = ht.view(k * q, B)
        return (y, h) if keep else y
    h = x2.new_empty(k * q, B)  # feature-major: a row tile of any block is contiguous
    sx = (x2.stride(0), p * x2.stride(1), x2.stride(1))  # x[b, i*p + c]
    sw1 = (w1.stride(0), w1.stride(1), w1.stride(2))
    sw2 = (w2.stride(0), w2.stride(1), w2.stride(2))
    cfg = configs.get("stage")
    _stage(x2, w1, h, B, k, q, p, sx, sw1, (1, q * B, B), cfg)
    # stage 2 reads element rr of block j at rr*l + j
    if l > 1 and s > 1:
        yb = x2.new_empty(B, l * s)  # block-major yb[b, j*s + a]: coalesced along a
        _stage(h, w2, yb, B, l, s, r, (1, B, l * B), sw2, (l * s, s, 1), cfg)
        _transpose_rows(yb, l, s, out=y)
    else:  # one block or one output a block: y's order is block-major already
        sy = (y.stride(0), y.stride(1), l * y.stride(1))  # y[b, a*l + j]
        _stage(h, w2, y, B, l, s, r, (1, B, l * B), sw2, sy, cfg)
    return (y, h) if keep else y


class _Partials:
    """Both weight gradients' split partials in one float32 buffer, ``(splits, *w1.shape)`` and
    ``(splits, *w2.shape)`` side by side, so that one launch sums and casts both."""

    def __init__(self, splits: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        self.shapes = (w1.shape, w2.shape)
        self.n1 = w1.numel()
        self.buf = torch.empty(splits, self.n1 + w2.numel(), device=w1.device, dtype=torch.float32)
        self.dw1 = self.buf[:, : self.n1].view(splits, *w1.shape)
        self.dw2 = self.buf[:, self.n1 :].view(splits, *w2.shape)

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
    _launch("wgrad", grid, args, config)


def monarch_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    path: str | None = None,
    configs: dict[str, triton.Config] | None = None,
    splits: int | None = None,
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dw1, dw2)`` for ``y = monarch(x, w1, w2)`` given ``dy``; ``h``, the
    forward's feature-major intermediate (k*q, B), spares recomputing it. ``path`` and
    ``configs`` as for ``monarch_forward``; ``splits``: the weight gradients' row splits."""
    _check(dy=dy2, x=x2, w1=w1, w2=w2)
    k, q, p, l, s, r = _shapes(x2, w1, w2)
    B = x2.shape[0]
    if tuple(dy2.shape) != (B, s * l):
        raise ValueError(
            f"monarch triton: grad has shape {tuple(dy2.shape)}, expected ({B}, {s * l})"
        )
    if h is not None and h.stride() != (B, 1):
        h = None  # not the forward's feature-major intermediate: recompute it
    configs = configs or {}

    def runs() -> dict:
        return {
            name: (lambda name=name: monarch_backward(dy2, x2, w1, w2, path=name, h=h))
            for name in PATHS
        }

    path = _path(path) or _choose("backward", x2, (w1, w2, h), runs)
    if splits is None:
        # Enough programs for about eight per SM (each reduction is a long, latency-bound
        # loop), but at least 256 rows of reduction each.
        tiles = max(1, (q // 64) * (p // 64))
        sms = _sm_count(x2.device)
        splits = max(1, min(_cdiv(8 * sms, max(k, l) * tiles), _cdiv(B, 256)))
    if path == "blas":
        return _blas_backward(dy2, x2, w1, w2, h, splits, configs.get("wgrad"))
    cfg = configs.get("stage")
    sx = (x2.stride(0), p * x2.stride(1), x2.stride(1))
    # dY[b, j, a] = dy[b, a*l + j]: put into block-major order once, for the two readers that
    # follow (no permutation to undo when l or s is 1)
    if l > 1 and s > 1:
        dy, sdy = _transpose_rows(dy2, s, l), (l * s, s, 1)
    else:
        dy, sdy = dy2, (dy2.stride(0), dy2.stride(1), l * dy2.stride(1))
    if h is None:  # stage 1 again, where the forward kept nothing
        h = x2.new_empty(k * q, B)
        sw1 = (w1.stride(0), w1.stride(1), w1.stride(2))
        _stage(x2, w1, h, B, k, q, p, sx, sw1, (1, q * B, B), cfg)
    # The input gradient is the transposed Monarch product: w2[j].T, then (l r) -> (r l), then
    # w1[i].T. dF, the gradient of the flat intermediate, is kept feature-major for dw1.
    sw2t = (w2.stride(0), w2.stride(2), w2.stride(1))
    sw1t = (w1.stride(0), w1.stride(2), w1.stride(1))
    df = x2.new_empty(k * q, B)
    dx = x2.new_empty(B, k * p)
    _stage(dy, w2, df, B, l, r, s, sdy, sw2t, (1, B, l * B), cfg)
    _stage(df, w1, dx, B, k, p, q, (1, q * B, B), sw1t, (dx.stride(0), p, 1), cfg)
    partials = _Partials(splits, w1, w2)
    wcfg = configs.get("wgrad")
    _wgrad(df, x2, partials.dw1, k, q, p, B, (1, q * B, B), sx, wcfg)
    # dw2[j] = dY[j].T @ G[j], with G[b, j, rr] = h[rr*l + j, b]
    _wgrad(dy, h, partials.dw2, l, s, r, B, sdy, (1, B, l * B), wcfg)
    return dx, *partials.finish(w1.dtype)


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


def _blas_backward(dy2, x2, w1, w2, h, splits, wgrad_config):
    """The backward on the vendor BLAS: dy put batch-last once (one Triton pass), the input
    gradient's two GEMMs writing the permuted layouts through strided views, and the weight
    gradients on the vendor GEMM (``vendor_weight_grads``) or on the deterministic
    split-reduction kernel."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    B = x2.shape[0]
    dyt = dy2.new_empty(l, s, B)
    _batch_last(dy2, dyt, l, s, to_flat=False)
    dht, dx = blas.input_grads(dyt, w1, w2, strided_out=True)
    h = blas.stage_one(x2, w1).view(k * q, B) if h is None else h
    if vendor_weight_grads(x2.device):
        return dx, *blas.weight_grads(dyt, dht, x2, h.view(k, q, B), l)
    sx = (x2.stride(0), p * x2.stride(1), x2.stride(1))
    partials = _Partials(splits, w1, w2)
    _wgrad(dht, x2, partials.dw1, k, q, p, B, (1, q * B, B), sx, wgrad_config)
    # dw2[j] = dY[j].T @ G[j], with G[b, j, rr] = h[rr*l + j, b]
    _wgrad(dyt, h, partials.dw2, l, s, r, B, (1, s * B, B), (1, B, l * B), wgrad_config)
    return dx, *partials.finish(w1.dtype)
