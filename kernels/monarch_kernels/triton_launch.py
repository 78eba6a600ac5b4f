# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Launchers for the Triton Monarch kernels: checks, allocation, path choice, autotuning.

``monarch_forward`` and ``monarch_backward`` take 2-d activations ``(B, features)`` with any
strides (the kernels take strides, so non-contiguous inputs are never copied) and return
fresh contiguous tensors. ``ops.py`` wraps them into the autograd-aware custom op.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import triton

from . import blas, direct, replay
from .configs import get_configs
from .pipeline_kernel import _monarch_pipeline_kernel, _zero_kernel
from .reference import monarch_shapes
from .triton_kernels import (
    _batch_last_kernel,
    _block_group_kernel,
    _block_matmul_kernel,
    _block_stage_wgrad_kernel,
    _block_wgrad_kernel,
    _monarch_fused_kernel,
    _sum_splits_kernel,
    _transpose_rows_kernel,
)

try:  # what a kernel that does not build or launch raises (ptxas's errors too, on Triton 3.2+)
    from triton.errors import TritonError as _BuildError
except ImportError:
    _BuildError = triton.CompilationError
PATH_ENV_VAR = "MONARCH_KERNELS_PATH"  # forces one of PATHS
# fused: one persistent kernel, intermediate in an L2 scratch; two_kernel: stage 2 writes y
# through grouped vector stores; three_kernel: stage 2 writes block-major, then each row is
# transposed into y; blas: the block products on the vendor BLAS (cuBLAS, hipBLASLt) with the
# middle permutation as a leading dimension, then one Triton pass for the output permutation
# (blas.py); chunked: three_kernel over row chunks whose intermediates fit in a share of the
# shared cache, so that they need not travel to and from memory; pipelined: the forward in one
# launch, each row tile's intermediates handed between programs through a ring of scratch
# slots in that cache (not chosen automatically until measured on a GPU). In the backward,
# two_kernel is the Triton chain with each weight gradient computed in the stage that reads the
# same gradient (narrow blocks; elsewhere it is three_kernel), three_kernel the chain with
# separate weight-gradient kernels, fused the fused input-gradient kernel, chunked the
# two_kernel chain over row chunks, and pipelined is chunked. Without a forced path each
# direction times its candidates once per shape.
PATHS = ("fused", "two_kernel", "three_kernel", "blas", "chunked", "pipelined")
# The path whose launches run each kernel kind with the config given for it (tests, tune): the
# one-block stage kernel writes block-major in three_kernel, the grouped one writes y in
# two_kernel; the backward's three_kernel computes weight gradients apart, its two_kernel inside
# the stages where blocks fit.
KIND_PATHS = {
    "stage": "three_kernel",
    "group": "two_kernel",
    "fused": "fused",
    "wgrad": "three_kernel",
    "stage_wgrad": "two_kernel",
    "pipeline": "pipelined",
}
# Compiler options of every launch. FMA contraction stays on as Triton has always defaulted;
# said explicitly, the kernels compile the same on Triton 3.10 (whose default turns it off)
# and Triton 3.9 does not warn each process about the coming change.
_OPTIONS = {"enable_fp_fusion": True}
_path_choice: dict[tuple, str] = {}  # (direction, shapes, strides, dtype, device) -> path
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCKS = 65535  # grid axis 1 carries the block index
MAX_ELEMENTS = 2**31 - 1  # row/feature offsets are computed in int32 before widening
CACHE_SHARE = 4  # the chunked path's scratch: a quarter of the shared cache (_cache_bytes) each
MAX_CHUNKS = 16  # and at most this many chunks (three launches each)
# rounds of work items between a row tile's stages in the pipelined forward; None: as many as
# the programs take at once, within half the shared cache (_pipeline_lag)
PIPELINE_LAG: int | None = None
_KEYS = {
    # the strides that say which side is permuted: stage 1 and stage 2 have the same sizes in
    # the square case but very different memory access
    "stage": ["B", "NBLK", "NOUT", "NRED", "stride_in_m", "stride_out_blk"],
    "group": ["B", "NBLK", "NOUT", "NRED", "stride_in_m", "stride_out_blk"],
    "fused": ["B", "K1", "O1", "C1", "K2", "O2", "C2", "FULL_SCRATCH"],
    "wgrad": ["B", "NBLK", "NOUT", "NRED"],
    "stage_wgrad": ["B", "NBLK", "NOUT", "NRED", "stride_in_m", "stride_out_m"],
}
_KERNELS = {
    "stage": _block_matmul_kernel,
    "group": _block_group_kernel,
    "fused": _monarch_fused_kernel,
    "wgrad": _block_wgrad_kernel,
    "stage_wgrad": _block_stage_wgrad_kernel,
    "pipeline": _monarch_pipeline_kernel,
}
GROUPED = True  # False sends every stage to the one-block kernel (tuning and tests)
_autotuned: dict[str, object] = {}  # kind -> Triton's autotuner over the backend's configs
_tuned: dict[tuple, triton.Config] = {}  # (kind, autotuning key) -> the config it chose
_key_positions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
_fitting: dict[tuple, list] = {}  # (the backend's stage_wgrad configs, blocks) -> those that fit


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv goes through Triton's JIT-function call: ~1.5 us a call


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()  # triton.next_power_of_2, for n >= 1


def _divides_blocks(config: triton.Config, nblk: int) -> bool:
    return nblk % config.kwargs["BLOCK_J"] == 0


def _divides(configs: list, named_args: dict, **kwargs) -> list:
    """Autotuning's pruning: the grouped configs whose BLOCK_J divides the block count (the
    launcher takes the grouped kernel only where one does)."""
    return [c for c in configs if _divides_blocks(c, named_args["NBLK"])]


def _covers(config: triton.Config, nout: int, nred: int) -> bool:
    return config.kwargs["BLOCK_O"] >= nout and config.kwargs["BLOCK_C"] >= nred


def _covering(configs: list, named_args: dict, **kwargs) -> list:
    """Autotuning's pruning for stage_wgrad: the configs whose tile holds a whole block."""
    return [c for c in configs if _covers(c, named_args["NOUT"], named_args["NRED"])]


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


def _launch(kind: str, grid, args: tuple, config: triton.Config | None, **const) -> None:
    """Launch ``kind`` with ``config``, else autotuned over the backend's configs.

    Autotuning runs through Triton's autotuner the first time a key is seen; after that the
    config it chose is launched directly, which spares every call the autotuner's own
    bookkeeping (a dict of all arguments and a key rebuilt per launch)."""
    kernel = _KERNELS[kind]
    if config is None and interpreting():
        config = get_configs(kind)[0]  # the interpreter cannot time configs
    if config is None:
        key = _tuning_key(kind, args, const)
        config = _tuned.get(key)
        if config is None:
            replay.spoil()  # the autotuner's timing launches are not the call's
            tuner = _autotuner(kind)
            tuner[grid](*args, **const, **_OPTIONS)
            if getattr(tuner, "best_config", None) is not None:
                _tuned[key] = tuner.best_config
            return
    _run(kernel, grid(config.kwargs), args, **const, **config.all_kwargs())


def _run(kernel, grid: tuple[int, ...], args: tuple, **constants) -> None:
    """``kernel[grid](*args, **constants)`` with the compiler options of every launch; once
    compiled, launched directly (``direct.py``), sparing each call Triton's argument handling.
    ``args`` are the non-constexpr parameters in order; the constexprs come by name."""
    direct.launch(kernel, grid, args, {**constants, **_OPTIONS})


def _autotuner(kind: str):
    if kind not in _autotuned:
        prune = {"group": _divides, "stage_wgrad": _covering}.get(kind)
        prune = {"early_config_prune": prune} if prune else None
        _autotuned[kind] = triton.autotune(
            configs=get_configs(kind), key=_KEYS[kind], prune_configs_by=prune
        )(_KERNELS[kind])
    return _autotuned[kind]


def _tuning_key(kind: str, args: tuple, const: dict) -> tuple:
    """What Triton's autotuner keys ``kind`` on (the ``_KEYS`` arguments and the tensors'
    dtypes), plus the constants, read from the positional ``args`` (a kind's launcher always
    passes tensors at the same positions)."""
    if kind not in _key_positions:
        names = _KERNELS[kind].arg_names[: len(args)]
        keys = tuple(names.index(k) for k in _KEYS[kind] if k in names)
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        _key_positions[kind] = keys, tensors
    keys, tensors = _key_positions[kind]
    return (
        kind,
        *[args[i] for i in keys],
        *[args[i].dtype for i in tensors],
        *const.items(),
    )


def _sm_count(device: torch.device) -> int:
    """SMs (CUs on AMD) of ``device``; a small stand-in under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _stage(inp, w, out, B, nblk, o, c, s_in, s_w, s_out, configs) -> None:
    """One block-diagonal stage; ``s_in``/``s_out`` are (row, block, feature) strides.

    Where the output's block index is the contiguous one (``y[b, a*l + j]``) and a grouped
    config's ``BLOCK_J`` divides the block count, the grouped kernel writes several blocks per
    program as vector stores; elsewhere the one-block kernel.
    """
    group = configs.get("group")
    interleaved = GROUPED and s_out[1] == 1
    candidates = ([group] if group else get_configs("group")) if interleaved else []
    fitting = [c for c in candidates if _divides_blocks(c, nblk)]
    if fitting:

        def grid(meta):
            tiles = _cdiv(B, meta["BLOCK_M"]) * _cdiv(o, meta["BLOCK_O"])
            return (tiles * (nblk // meta["BLOCK_J"]),)

        args = (inp, w, out, B, nblk, o, c, *s_in, *s_w, *s_out)
        # autotuning prunes the configs that do not divide; the interpreter takes the first
        # that does
        _launch("group", grid, args, group or (fitting[0] if interpreting() else None))
        return

    def grid(meta):
        return (_cdiv(B, meta["BLOCK_M"]) * _cdiv(o, meta["BLOCK_O"]) * nblk,)

    args = (inp, w, out, B, nblk, o, c, *s_in, *s_w, *s_out)
    # a batch-contiguous output (the feature-major intermediates) is computed transposed
    _launch("stage", grid, args, configs.get("stage"), TRANS_OUT=s_out[0] == 1)


def _fused(inp, w1, w2, out, scratch, sizes, slot_rows, strides, nprog, full, config) -> None:
    """Both stages in one persistent launch of at most ``nprog`` programs."""
    B = sizes[0]

    def grid(meta):
        return (max(1, min(_cdiv(B, meta["BLOCK_M"]), nprog)),)

    args = (inp, w1, w2, out, scratch, *sizes, slot_rows, *strides)
    _launch("fused", grid, args, config, FULL_SCRATCH=full)


def _signature(*tensors: torch.Tensor | None) -> list:
    """What a launch plan (``replay.py``) is keyed on for each tensor: everything the launchers
    read of it but its address, and of that its 16-byte alignment, which the compiled
    kernels depend on."""
    return [
        None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16)
        for t in tensors
    ]


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

    interp = interpreting()
    if configs or num_programs or chunk_rows or not replay.enabled(interp):
        return launcher()
    key = ("forward", _path(path), keep, GROUPED, interp, *_signature(x2, w1, w2))
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
        sms = _sm_count(x2.device)
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
        nprog = num_programs or 2 * _sm_count(x2.device)
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


def _pipelined(x2, w1, w2, y, strides, nprog: int, config, keep: bool) -> torch.Tensor | None:
    """The forward in one launch of at most ``nprog`` persistent programs (and one to zero its
    counters), with ``config`` or the fastest of the backend's configs, timed here on first
    use of a shape (Triton's autotuner would rerun the launch without zeroing them; inside a
    CUDA-graph capture, where nothing can be timed, the first config). With ``keep``, returns
    the whole feature-major intermediate (k*q, B), which stage 1 then writes."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    B = x2.shape[0]
    kept = x2.new_empty(k * q, B) if keep else None

    def launch(cfg: triton.Config) -> None:
        bm = cfg.kwargs["BLOCK_M"]
        tiles = _cdiv(B, bm)
        # stage items of about 512 outputs; transpose items of 16 rows unless the config says
        # (PARTS a tile), moving tiles as _transpose_rows does
        j1, j2 = _blocks_per_item(k, q), _blocks_per_item(l, s)
        parts = cfg.kwargs.get("PARTS") or max(1, bm // 16)
        per_round = k // j1 + l // j2 + parts
        slot_bytes = bm * (k * q + l * s) * x2.element_size()
        lag = PIPELINE_LAG or _pipeline_lag(nprog, per_round, slot_bytes, x2.device)
        ring = min(2 * lag + 2, tiles)  # > 2*lag, or every tile a slot of its own
        h = x2.new_empty(ring * k * q * bm) if kept is None else kept
        yb = x2.new_empty(ring * bm * l * s)
        sync = torch.empty(1 + 3 * tiles, dtype=torch.int32, device=x2.device)
        _run(_zero_kernel, (_cdiv(sync.numel(), 1024),), (sync, sync.numel()), BLOCK=1024)
        bp, bq = min(64, _pow2(l)), min(64, _pow2(s))
        bt = max(1, min(bm // parts, 8192 // (bp * bq)))
        grid = (max(1, min(nprog, (tiles + 2 * lag) * per_round)),)
        args = (x2, w1, w2, y, h, yb, sync, B, k, q, p, r, *strides[0], *strides[1])
        args += (*strides[2], y.stride(0), lag, ring)
        const = dict(L=l, S=s, J1=j1, J2=j2, BLOCK_P=bp, BLOCK_Q=bq, BLOCK_T=bt, KEEP=keep)
        if "PARTS" not in cfg.kwargs:  # an explicit config may leave it out
            const["PARTS"] = parts
        _launch("pipeline", lambda meta: grid, args, cfg, **const)

    if config is None:
        key = ("pipeline", keep, *_signature(x2, w1, w2))
        untimed = interpreting() or torch.cuda.is_current_stream_capturing()
        config = _tuned.get(key) or (get_configs("pipeline")[0] if untimed else None)
        if config is None:
            replay.spoil()  # the timing launches are not the call's
            config = _tuned[key] = _fastest(launch, get_configs("pipeline"))
    launch(config)
    return kept


def _pipeline_lag(nprog: int, per_round: int, slot_bytes: int, device: torch.device) -> int:
    """Rounds between a tile's stages: as many as ``nprog`` programs hold at once, so that an
    item's inputs were taken that many tickets earlier and are usually done; fewer where the
    ring of ``2*lag + 2`` slots would take more than half the shared cache (_cache_bytes)."""
    fits = (_cache_bytes(device) // 2 // slot_bytes - 2) // 2
    return max(1, min(_cdiv(nprog, per_round), fits))


def _blocks_per_item(nblk: int, width: int) -> int:
    """Blocks per stage item of the pipelined forward: 8, 4, 2 or 1, dividing the block
    count, about 512 outputs an item (one block where blocks are wider)."""
    return next(j for j in (8, 4, 2, 1) if nblk % j == 0 and j * width <= max(width, 512))


def _fastest(launch, configs: list) -> triton.Config:
    """The config of ``configs`` whose ``launch(config)`` runs fastest; those that do not build
    on this chip are skipped, as Triton's autotuner skips them."""
    times = {}
    for cfg in configs:
        try:
            launch(cfg)  # compiles
        except (_BuildError, triton.OutOfResources):
            continue
        times[cfg] = min(_call_ms(lambda c=cfg: launch(c), calls=3) for _ in range(3))
    if not times:
        raise RuntimeError("monarch_kernels: no pipelined config builds on this device")
    return min(times, key=times.get)


# AMD Instinct MI300X/MI300A/MI325X (gfx942) and MI350X/MI355X (gfx950): each die's L2 (4 MB) is
# its own, and programs are spread over the dies, so what one program writes and another reads
# meets in the 256 MB Infinity Cache that all dies share (AMD's specification tables)
_SHARED_CACHE_BYTES = {"gfx942": 256 * 2**20, "gfx950": 256 * 2**20}


def _cache_bytes(device: torch.device) -> int:
    """The size of the last cache every program of a launch shares: the L2 on NVIDIA, the
    Infinity Cache on AMD Instinct; a small stand-in under the interpreter, so that test
    sizes come in several chunks."""
    if device.type != "cuda":
        return 16 * 1024
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "").split(":")[0]  # e.g. "gfx942:sramecc+:xnack-"
    return _SHARED_CACHE_BYTES.get(arch, props.L2_cache_size)


def _chunk_rows(B: int, row_bytes: int, device: torch.device) -> int:
    """Rows per chunk of the chunked path: as many as keep each intermediate's chunk within
    ``1/CACHE_SHARE`` of the shared cache (``_cache_bytes``), in a multiple of 128 rows, which
    row tiles divide (of 16 for small chunks), but no more than ``MAX_CHUNKS`` chunks.
    Multiples of 16 rows start every chunk 16-byte aligned in the feature-major
    intermediate."""
    fit = _cache_bytes(device) // CACHE_SHARE // row_bytes
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
    if interpreting():
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


def _choose_backward_path(dy2, x2, w1, w2, h) -> str:
    if interpreting():
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


def _choose(direction: str, tensors: tuple, make_runs, capturing: str) -> str:
    """The fastest of the runs ``make_runs()`` gives, for this direction and shape, timed once
    and kept.

    Which path wins depends on the chip, the host and the shape: grouped vector stores against
    one more pass at copy speed, Triton's block products against the vendor BLAS's, three
    launches against one. Like Triton's autotuner, the choice is timed on first use and kept
    per shape. Inside a CUDA-graph capture nothing can be timed, so a shape first seen there
    takes ``capturing``.
    """
    first = tensors[0]
    key = (
        direction,
        *((tuple(t.shape), t.stride()) for t in tensors),
        first.dtype,
        first.device,
    )
    if key not in _path_choice:
        if torch.cuda.is_current_stream_capturing():
            return capturing
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
        # within 3% of the fastest, the first listed: candidates come fewest launches first,
        # and where the device's times tie, the host's share decides a training step
        fastest = min(best.values())
        _path_choice[key] = next(p for p in runs if best[p] <= 1.03 * fastest)
    return _path_choice[key]


def _call_ms(run, calls: int = 8) -> float:
    """Milliseconds per call of ``run`` called back to back, as a training loop calls it: the
    device's time where it is the slower, the host's (Python and launches) where that is.
    Paths differ in both: the blas path launches fewer kernels, the Triton paths move less."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def _runs_here(path: str, run) -> bool:
    """Run ``path`` once (autotuning and compilation stay out of the comparison); False, with a
    warning, if it fails. A config or kernel that does not build on an untried chip (too much
    shared memory, say) then costs speed, not the user's run."""
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
    _launch("wgrad", grid, args, config)


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
    _launch("stage_wgrad", lambda meta: (splits, nblk), args, config, TRANS_OUT=trans)


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

    interp = interpreting()
    if configs or num_programs or splits or chunk_rows or not replay.enabled(interp):
        return launcher()
    key = ("backward", _path(path), GROUPED, interp, *_signature(dy2, x2, w1, w2, h))
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
        sms = _sm_count(x2.device)
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
        how = ("fuse", configs.get("stage_wgrad") or (fitting[0] if interpreting() else None))
    elif path == "fused":
        how = ("fused", num_programs or 4 * _sm_count(x2.device))
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
