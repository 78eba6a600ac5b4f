"""Autotune configurations, one function per Triton backend, and the one ``is_hip()``.

Six kernel kinds share the meta-parameters ``BLOCK_M`` (batch rows), ``BLOCK_O`` (output
features of a block) and ``BLOCK_C`` (the reduction):

* ``"stage"`` — one block-diagonal stage, one block per program (``_block_matmul_kernel``),
  wherever the output's features are contiguous;
* ``"group"`` — one stage, ``BLOCK_J`` blocks per program (``_block_group_kernel``), where the
  output interleaves the blocks (``y[b, a*l + j]``): ``BLOCK_J`` is the run of consecutive
  outputs each thread writes with one vector store; ``DENSE`` computes the group as one
  matmul tile (``BLOCK_J`` times the multiply-adds, one pipelined loop);
* ``"fused"`` — both stages in one pass (``_monarch_fused_kernel``). Its per-program scratch
  is ``BLOCK_M x k*q`` and must stay in L2, so its ``BLOCK_M`` stays small;
* ``"wgrad"`` — weight gradients (``_block_wgrad_kernel``); ``BLOCK_M`` is the reduction step;
* ``"stage_wgrad"`` — a backward stage and a weight gradient from the same loads, for narrow
  blocks (``_block_stage_wgrad_kernel``): ``BLOCK_O`` and ``BLOCK_C`` must cover a whole block
  (the launcher prunes those that do not), and the block's weights stay resident;
* ``"pipeline"`` — the forward in one launch through a ring of L2 scratch slots
  (``_monarch_pipeline_kernel``); ``BLOCK_M`` is a row tile, the unit handed between stages,
  and ``PARTS`` the transpose items a tile's rows are cut into.

Override with ``MONARCH_KERNELS_CONFIGS``: ``cuda`` or ``hip`` forces a backend's set, or give
configs explicitly, ``;``-separated, e.g.
``MONARCH_KERNELS_CONFIGS="BLOCK_M=64,BLOCK_O=64,BLOCK_C=32,num_warps=4,num_stages=3"``
(HIP options such as ``waves_per_eu=2`` are accepted too). An explicit list applies to every
kind, except that ``fused`` keeps only entries with ``BLOCK_M <= 64`` and ``group`` only
entries with ``BLOCK_J`` (the backend's set when there are none).
"""

from __future__ import annotations

import os

import torch
import triton

ENV_VAR = "MONARCH_KERNELS_CONFIGS"
FUSED_MAX_BLOCK_M = 64
KINDS = ("stage", "group", "fused", "wgrad", "stage_wgrad", "pipeline")

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


def _fits(cfg: triton.Config, smem_bytes: int, elt: int = 2, resident: bool = False) -> bool:
    """Operand tiles of every pipeline stage must fit the chip's shared memory / LDS.

    A grouped config computes its blocks one after another, so it needs one block's tiles at
    a time (a dense one: one block's rows and the whole group's weight operand), plus room to
    interleave the fp32 accumulators of its blocks on the way out.
    ``resident``: the stage_wgrad kernel, which pipelines two row tiles (BLOCK_M x BLOCK_C and
    BLOCK_M x BLOCK_O) and keeps a BLOCK_C x BLOCK_O weight tile.
    """
    kw = cfg.kwargs
    stages = max(cfg.num_stages, 1)
    m, o, c = kw["BLOCK_M"], kw["BLOCK_O"], kw["BLOCK_C"]
    # a dense group's weight operand holds the group's blocks side by side
    w_cols = o * kw["BLOCK_J"] if kw.get("DENSE") else o
    tiles = m * c + (m if resident else c) * w_cols  # per pipeline stage
    need = tiles * elt * stages + (c * o * elt if resident else 0)
    if "BLOCK_J" in kw:
        need = max(need, kw["BLOCK_J"] * m * o * 4)
    return need <= smem_bytes


def _group(shapes, dense: bool = False, **options) -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_J": j, "BLOCK_M": m, "BLOCK_O": o, "BLOCK_C": c, "DENSE": dense, **options},
            num_warps=w,
            num_stages=s,
        )
        for j, m, o, c, w, s in shapes
    ]


def _with_parts(cfgs: list[triton.Config]) -> list[triton.Config]:
    """The pipelined kernel's configs with ``PARTS``, its transpose items per row tile: items
    of 16 rows, and for the first config also of 4 rows. A transpose item moves its rows one
    small tile at a time, each load waited for, so shorter items let more programs write y
    at once, for a ticket each."""

    def parts(cfg: triton.Config, rows: int) -> triton.Config:
        kwargs = {**cfg.kwargs, "PARTS": max(1, cfg.kwargs["BLOCK_M"] // rows)}
        return triton.Config(kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    return [parts(c, 16) for c in cfgs] + [parts(cfgs[0], 4)]


def _cuda_configs(kind: str = "stage") -> list[triton.Config]:
    """NVIDIA Ampere (A100: 164 KB smem/SM) and Hopper (H100/H200: 228 KB smem/SM).

    Monarch blocks are narrow (32-256), so BLOCK_O/BLOCK_C beyond 128 only pad. Wide BLOCK_M
    amortises the weight tile over many rows, which is what the memory-bound many-block case
    needs; 3-4 stages of cp.async/TMA pipelining hide HBM latency within the 160 KB we plan for.
    """
    if kind == "group":
        # (J, M, O, C, warps, stages). J blocks per program, each a 2-d tile; J=16 bf16
        # outputs fill a 32-byte sector, J=8 half of one (its neighbour program, running
        # beside it, the other half). J*M*O <= 16K keeps the fp32 accumulators at 128
        # registers a thread for 4 warps. The first is small enough for float32 on an A100.
        # 16-32 rows trade Hopper's wgmma (64 rows a warpgroup) for longer runs of blocks and
        # wider output tiles, so that the intermediate is read fewer times.
        shapes = [
            (4, 64, 32, 32, 4, 2),
            (16, 64, 16, 64, 4, 2),
            (8, 64, 32, 64, 4, 2),
            (4, 64, 64, 64, 4, 3),
            (2, 128, 64, 64, 8, 3),
            (8, 32, 64, 64, 4, 2),
            (16, 32, 32, 64, 4, 2),
            (16, 16, 64, 64, 4, 2),
            (32, 16, 32, 64, 4, 2),
        ]
        # Dense groups: the group is one matmul tile (BLOCK_J times the multiply-adds) whose
        # loop keeps loads in flight across blocks; N = BLOCK_O * BLOCK_J = 128 is a full
        # Hopper wgmma / Ampere mma tile, and 128 rows spread the weight operand's loads over
        # twice the rows that 64 do.
        dense = [(4, 128, 32, 64, 8, 3), (4, 64, 32, 64, 4, 3), (2, 128, 64, 64, 8, 3)]
        cfgs = _group(shapes) + _group(dense, dense=True)
        return [c for c in cfgs if _fits(c, _SMEM_BYTES["cuda"])]
    if kind == "fused":
        # One program per SM holds BLOCK_M x k*q of scratch in L2: 16-32 rows keep 132 SMs'
        # scratch within a few tens of MB at width 4096.
        shapes = [(16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (32, 128, 64, 8, 3), (64, 64, 32, 4, 3)]
    elif kind == "pipeline":
        # A row tile's two intermediates take a ring slot each (2 x BLOCK_M x width: 1 MB for
        # 64 rows at width 4096 in bf16; ten slots stay within a fifth of an H200's L2); two
        # programs an SM keep one's loads in flight while the other waits on a counter.
        shapes = [(64, 64, 64, 4, 2), (64, 64, 32, 4, 3), (128, 64, 64, 8, 2), (32, 64, 64, 4, 2)]
    elif kind == "wgrad":
        # BLOCK_M is the reduction here: long K-loops favour deeper pipelines.
        shapes = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (32, 32, 32, 4, 4)]
    elif kind == "stage_wgrad":
        # a whole block per program (O = C covers it), weights resident; rows are both the
        # stage's M and the reduction's K, so the wgrad's deep pipelines again. 128-wide blocks
        # take 8 warps for the 128 x 128 fp32 accumulator.
        shapes = [
            (64, 64, 64, 4, 3),
            (128, 64, 64, 4, 4),
            (128, 64, 64, 8, 3),
            (64, 32, 32, 4, 4),
            (64, 128, 128, 8, 2),
        ]
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
    cfgs = _with_parts(cfgs) if kind == "pipeline" else cfgs
    return [c for c in cfgs if _fits(c, _SMEM_BYTES["cuda"], resident=kind == "stage_wgrad")]


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
    if kind == "group":
        # 64 KB of LDS on MI300X: one block's 64-row tile and weights at a time (the blocks of
        # a group are computed one after another); MI355X's 160 KB takes deeper pipelines.
        shapes = [(4, 64, 32, 32, 4, 2, 2), (8, 64, 16, 64, 4, 2, 2), (16, 32, 16, 64, 4, 2, 2)]
        # dense groups (see _cuda_configs): a 64 x 128 tile, two stages within 48 KB
        dense = [(4, 64, 32, 64, 4, 2, 2), (2, 64, 64, 64, 4, 2, 2)]
        if big:
            shapes += [(8, 64, 32, 64, 4, 3, 1), (4, 128, 32, 64, 8, 3, 1)]
            dense += [(4, 128, 32, 64, 8, 2, 1)]
        cfgs = [
            cfg
            for group, is_dense in ((shapes, False), (dense, True))
            for *shape, wpe in group
            for cfg in _group([shape], is_dense, waves_per_eu=wpe, matrix_instr_nonkdim=16)
        ]
        return [c for c in cfgs if _fits(c, _SMEM_BYTES["gfx950" if big else "gfx942"])]
    if kind == "fused":
        shapes = [(16, 64, 64, 4, 2, 2), (32, 64, 64, 4, 2, 2), (64, 64, 32, 4, 2, 1)]
    elif kind == "pipeline":
        # as on NVIDIA; MI300X's 8 dies each have their own 4 MB L2, so slots handed between
        # programs on different dies meet in the 256 MB Infinity Cache instead. Its three item
        # kinds in one kernel take 140-220 VGPRs (benchmarks/kernel_registers.py); on gfx950
        # the 64 x 64 x 64 tile needs more than the 256 that two waves an EU leave and spills,
        # so MI355X takes a 128-row tile over 8 waves instead (190 VGPRs).
        shapes = [(64, 64, 32, 4, 2, 1), (32, 64, 64, 4, 2, 2)]
        shapes.append((128, 64, 32, 8, 2, 1) if big else (64, 64, 64, 4, 2, 2))
    elif kind == "wgrad":
        shapes = [(64, 64, 64, 4, 2, 2), (128, 64, 32, 4, 2, 2), (32, 32, 32, 4, 2, 2)]
        if big:
            shapes.append((128, 128, 64, 8, 2, 1))
    elif kind == "stage_wgrad":
        # MI300X's 64 KB: two 64-row tiles in flight and one 64 x 64 weight tile (40 KB)
        shapes = [(64, 64, 64, 4, 2, 2), (32, 64, 64, 4, 2, 2), (64, 32, 32, 4, 2, 2)]
        if big:
            shapes += [(128, 64, 64, 4, 2, 1), (64, 128, 128, 8, 2, 1)]
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
    cfgs = _with_parts(cfgs) if kind == "pipeline" else cfgs
    smem = _SMEM_BYTES["gfx950" if big else "gfx942"]
    return [c for c in cfgs if _fits(c, smem, resident=kind == "stage_wgrad")]


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
    # entries with BLOCK_J are for the grouped kernel, the others for the rest; a kind that
    # the list gives nothing for keeps the backend's set
    cfgs = [c for c in _parse(spec) if ("BLOCK_J" in c.kwargs) == (kind == "group")]
    if not cfgs:
        return _hip_configs(kind) if is_hip() else _cuda_configs(kind)
    if kind == "fused":
        cfgs = [c for c in cfgs if c.kwargs["BLOCK_M"] <= FUSED_MAX_BLOCK_M]
        if not cfgs:
            raise ValueError(f"{ENV_VAR}: the fused kernel needs an entry with BLOCK_M <= 64")
    return cfgs
