"""Autotune configurations, one function per Triton backend, and the one ``is_hip()``.

Two kernel kinds share the meta-parameters ``BLOCK_M`` (batch rows), ``BLOCK_O`` (output
features of a block) and ``BLOCK_C`` (the reduction):

* ``"stage"`` — one block-diagonal stage, one block per program (``_block_matmul_kernel``);
* ``"wgrad"`` — weight gradients (``_block_wgrad_kernel``); ``BLOCK_M`` is the reduction step.

Override with ``MONARCH_KERNELS_CONFIGS``: ``cuda`` or ``hip`` forces a backend's set, or give
configs explicitly, ``;``-separated, e.g.
``MONARCH_KERNELS_CONFIGS="BLOCK_M=64,BLOCK_O=64,BLOCK_C=32,num_warps=4,num_stages=3"``
(HIP options such as ``waves_per_eu=2`` are accepted too). An explicit list applies to both
kinds.
"""

from __future__ import annotations

import os

import torch
import triton

ENV_VAR = "MONARCH_KERNELS_CONFIGS"
KINDS = ("stage", "wgrad")

# Shared memory (NVIDIA) / LDS (AMD) per SM or CU that one program may plan for.
_SMEM_BYTES = {"cuda": 160 * 1024, "gfx942": 64 * 1024, "gfx950": 160 * 1024}


def is_hip() -> bool:
    """True when the active Triton backend is AMD's (ROCm), from the driver or torch's build."""
    try:
        return triton.runtime.driver.active.get_current_target().backend == "hip"
    except (RuntimeError, AttributeError, IndexError):
        return torch.version.hip is not None


def hip_arch() -> str:
    """The gfx name of the active AMD GPU, ``gfx942`` (MI300X) when it cannot be read."""
    try:
        return str(triton.runtime.driver.active.get_current_target().arch)
    except (RuntimeError, AttributeError, IndexError):
        return "gfx942"


def _fits(cfg: triton.Config, smem_bytes: int, elt: int = 2) -> bool:
    """Operand tiles of every pipeline stage must fit the chip's shared memory / LDS."""
    kw = cfg.kwargs
    m, o, c = kw["BLOCK_M"], kw["BLOCK_O"], kw["BLOCK_C"]
    return (m * c + c * o) * elt * max(cfg.num_stages, 1) <= smem_bytes


def _cuda_configs(kind: str = "stage") -> list[triton.Config]:
    """NVIDIA Ampere (A100: 164 KB smem/SM) and Hopper (H100/H200: 228 KB smem/SM).

    Monarch blocks are narrow (32-256), so BLOCK_O/BLOCK_C beyond 128 only pad. Wide BLOCK_M
    amortises the weight tile over many rows, which is what the memory-bound many-block case
    needs; 3-4 stages of cp.async/TMA pipelining hide HBM latency within the 160 KB we plan for.
    """
    if kind == "wgrad":
        # BLOCK_M is the reduction here: long K-loops favour deeper pipelines.
        shapes = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (32, 32, 32, 4, 4)]
    else:
        # the last three are Hopper-sized matmul tiles for wide blocks (compute-bound)
        shapes = [
            (64, 64, 32, 4, 3),
            (128, 64, 32, 4, 3),
            (128, 128, 32, 8, 3),
            (128, 64, 64, 4, 4),
            (32, 64, 64, 4, 4),
            (128, 256, 64, 8, 3),
            (128, 128, 64, 8, 4),
            (256, 128, 64, 8, 3),
        ]
    cfgs = [
        triton.Config({"BLOCK_M": m, "BLOCK_O": o, "BLOCK_C": c}, num_warps=w, num_stages=s)
        for m, o, c, w, s in shapes
    ]
    return [c for c in cfgs if _fits(c, _SMEM_BYTES["cuda"])]


def _hip_configs(kind: str = "stage", arch: str | None = None) -> list[triton.Config]:
    """AMD CDNA3 (MI300X, gfx942: 304 CUs, 64 KB LDS/CU) and CDNA4 (MI355X, gfx950: 160 KB LDS).

    A wavefront is 64 lanes, so num_warps=4 is already 256 threads. The AMD stream pipeliner
    wants num_stages=2 (one tile in flight; more only spends LDS, which MI300 has 64 KB of).
    waves_per_eu=2 lets two programs share an EU to hide HBM latency in the memory-bound
    case; matrix_instr_nonkdim=16 picks 16x16 MFMA, which wastes less on narrow blocks than
    32x32. MI355X's larger LDS admits the wider tiles.
    """
    arch = arch or hip_arch()
    big = arch.startswith("gfx95")
    if kind == "wgrad":
        shapes = [(64, 64, 64, 4, 2, 2), (128, 64, 32, 4, 2, 2), (32, 32, 32, 4, 2, 2)]
        if big:
            shapes.append((128, 128, 64, 8, 2, 1))
    else:
        shapes = [(64, 64, 32, 4, 2, 2), (128, 64, 32, 4, 2, 2), (32, 64, 64, 4, 2, 2)]
        if big:
            shapes += [(128, 128, 64, 8, 2, 1), (256, 64, 64, 8, 2, 1)]
    cfgs = [
        triton.Config(
            {
                "BLOCK_M": m,
                "BLOCK_O": o,
                "BLOCK_C": c,
                "waves_per_eu": wpe,
                "matrix_instr_nonkdim": 16,
            },
            num_warps=w,
            num_stages=s,
        )
        for m, o, c, w, s, wpe in shapes
    ]
    return [c for c in cfgs if _fits(c, _SMEM_BYTES["gfx950" if big else "gfx942"])]


def _parse(spec: str) -> list[triton.Config]:
    cfgs = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        kwargs, opts = {}, {}
        for item in entry.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"{ENV_VAR}: expected KEY=INT items, got {item!r} in {entry!r}")
            (opts if key in ("num_warps", "num_stages") else kwargs)[key] = int(value)
        missing = {"BLOCK_M", "BLOCK_O", "BLOCK_C"} - kwargs.keys()
        if missing:
            raise ValueError(f"{ENV_VAR}: entry {entry!r} lacks {', '.join(sorted(missing))}")
        cfgs.append(triton.Config(kwargs, **opts))
    return cfgs


def _cover(n: int) -> int:
    """The smallest power-of-two tile, at least 16 (``tl.dot``'s least), that covers ``n``."""
    return max(16, 1 << max(0, n - 1).bit_length())


# Multiply-adds below which one launch of any config is over in well under the launch's own
# few microseconds (16M at the H200's ~400 TFLOP/s of bf16 is 0.1 us): nothing to time.
TINY = 2**24


def prune(configs: list[triton.Config], named_args: dict, **_kwargs) -> list[triton.Config]:
    """The configs worth timing for one launch's sizes (Triton's ``early_config_prune``).

    A tile wider than its dimension only computes padding: at batch 64 with blocks of 64
    features, ``BLOCK_M=128`` and ``BLOCK_M=64`` run the same tile with half of the first
    masked. Each config's tile is clipped to what its sizes need, and of the configs that
    then coincide only the one with the least padding is kept. Below ``TINY`` multiply-adds
    only the config with the smallest tile is kept (the most programs for a small grid):
    the first use of a notebook's small model on an H200 spent over a minute compiling and
    timing configs whose launches all took the same few microseconds. Rows are ``B`` for a
    stage and ``ROWS_PER_SPLIT`` for the weight gradients, whose ``BLOCK_M`` is the
    reduction step."""
    rows = named_args.get("ROWS_PER_SPLIT", named_args["B"])
    sizes = {"BLOCK_M": rows, "BLOCK_O": named_args["NOUT"], "BLOCK_C": named_args["NRED"]}
    kept: dict[tuple, triton.Config] = {}
    for cfg in configs:
        clipped = {k: min(v, _cover(sizes[k])) if k in sizes else v for k, v in cfg.kwargs.items()}
        same = (tuple(sorted(clipped.items())), cfg.num_warps, cfg.num_stages)
        if same not in kept or _tile(cfg) < _tile(kept[same]):
            kept[same] = cfg
    left = list(kept.values())
    if named_args["B"] * named_args["NBLK"] * sizes["BLOCK_O"] * sizes["BLOCK_C"] < TINY:
        return [min(left, key=_tile)]
    return left


def _tile(cfg: triton.Config) -> int:
    kw = cfg.kwargs
    return kw["BLOCK_M"] * kw["BLOCK_O"] * kw["BLOCK_C"]


_cache: dict[tuple[str, str], list[triton.Config]] = {}


def get_configs(kind: str) -> list[triton.Config]:
    """The configs autotuning tries for ``kind``: the override, else the active backend's.

    Kept per (kind, override), since launchers ask on every call."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    spec = os.environ.get(ENV_VAR, "").strip()
    key = (kind, spec)
    if key not in _cache:
        _cache[key] = _configs_for(kind, spec)
    return _cache[key]


def _configs_for(kind: str, spec: str) -> list[triton.Config]:
    if spec in ("", "cuda", "hip"):
        hip = is_hip() if spec == "" else spec == "hip"
        return _hip_configs(kind) if hip else _cuda_configs(kind)
    return _parse(spec)
