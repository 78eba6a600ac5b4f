# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""What every Triton launcher shares: the paths, argument checks, launching (autotuned, then
direct), the one-stage and fused launches, row permutations, and the device's SM count and
shared cache.

The entry points are ``forward_launch.monarch_forward`` and
``backward_launch.monarch_backward``; ``pipeline_launch.py`` launches the one-launch forward
and ``path_choice.py`` times the paths. Those modules read the device's facts
(``interpreting``, ``_sm_count``, ``_cache_bytes``), ``GROUPED``, ``_launch`` and the tuned
configs through this module (``launch.X``), so that one assignment here (tests, tuning)
reaches every launcher.
"""

from __future__ import annotations

import os

import torch
import triton

from . import direct, replay
from .configs import get_configs
from .pipeline_kernel import _monarch_pipeline_kernel
from .reference import monarch_shapes
from .triton_kernels import (
    _batch_last_kernel,
    _block_group_kernel,
    _block_matmul_kernel,
    _block_stage_wgrad_kernel,
    _block_wgrad_kernel,
    _monarch_fused_kernel,
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
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCKS = 65535  # grid axis 1 carries the block index
MAX_ELEMENTS = 2**31 - 1  # row/feature offsets are computed in int32 before widening
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
