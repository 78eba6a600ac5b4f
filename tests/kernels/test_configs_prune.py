"""``configs.prune``, the autotuner's early prune: which configs a launch's sizes can tell apart.

Read without a GPU: the prune sees only the launch's sizes. On an H200 the first step of
notebook 04's small model spent 114 s compiling and timing every config of every launch."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from monarch_kernels.configs import TINY, _cuda_configs, _hip_configs, prune

SETS = {
    "cuda": _cuda_configs,
    "gfx942": lambda kind: _hip_configs(kind, arch="gfx942"),
    "gfx950": lambda kind: _hip_configs(kind, arch="gfx950"),
}


def _sizes(kind: str, B: int, nblk: int, nout: int, nred: int) -> dict:
    args = {"B": B, "NBLK": nblk, "NOUT": nout, "NRED": nred}
    if kind == "wgrad":
        args["ROWS_PER_SPLIT"] = B
    return args


def _tile(cfg) -> tuple[int, int, int]:
    return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_O"], cfg.kwargs["BLOCK_C"]


@pytest.mark.parametrize("backend", SETS)
@pytest.mark.parametrize("kind", ["stage", "wgrad"])
def test_a_small_launch_runs_one_config_untimed(backend, kind):
    configs = SETS[backend](kind)
    # notebook 04: batch 64, 4 blocks of 64 (and of 16 into the first layer)
    for sizes in [(64, 4, 64, 16), (64, 4, 64, 64), (899, 4, 64, 64)]:
        args = _sizes(kind, *sizes)
        assert args["B"] * args["NBLK"] * args["NOUT"] * args["NRED"] < TINY
        kept = prune(configs, args)
        assert len(kept) == 1, kept
        assert kept[0] in configs  # one of the set's own, not a made-up one
        smallest = min(m * o * c for m, o, c in map(_tile, configs))
        assert (
            kept[0].kwargs["BLOCK_M"] * kept[0].kwargs["BLOCK_O"] * kept[0].kwargs["BLOCK_C"]
            == smallest
        )


@pytest.mark.parametrize("backend", SETS)
@pytest.mark.parametrize("kind", ["stage", "wgrad"])
def test_a_large_launch_keeps_every_config_its_sizes_tell_apart(backend, kind):
    configs = SETS[backend](kind)
    # the benchmark's widths: 64 blocks of 64, 4 of 1024, batch 16384
    for sizes in [(16384, 64, 64, 64), (16384, 4, 1024, 1024)]:
        args = _sizes(kind, *sizes)
        kept = prune(configs, args)
        assert kept and all(c in configs for c in kept)
        cover = {"BLOCK_M": 16384, "BLOCK_O": sizes[2], "BLOCK_C": sizes[3]}
        # every distinct clipped tile survives, once
        assert sorted(_clipped(c, cover) for c in kept) == sorted(
            {_clipped(c, cover) for c in configs}
        )


def _clipped(cfg, cover: dict) -> tuple:
    kw = {k: min(v, cover[k]) if k in cover else v for k, v in cfg.kwargs.items()}
    return tuple(sorted(kw.items())), cfg.num_warps, cfg.num_stages


def test_configs_that_only_pad_give_way_to_the_one_with_least_padding():
    configs = _cuda_configs("stage")
    # 2,048 rows of 16 blocks with 32 features each way: BLOCK_O and BLOCK_C of 64 or more
    # compute padding; above TINY, so the rest are timed
    args = _sizes("stage", 2048, 16, 32, 32)
    assert TINY <= 2048 * 16 * 32 * 32
    kept = prune(configs, args)
    assert len(kept) < len(configs)
    tiles = [_tile(c) for c in kept]
    # (128, 64, 32) and (128, 128, 32) with 4 and 8 warps: both clip to (128, 32, 32)
    assert (128, 64, 32) in tiles and (128, 128, 32) in tiles  # different warps: both timed
    assert (
        128,
        256,
        64,
    ) not in tiles  # clips to (128, 32, 32) at 8 warps, 3 stages, as (128, 128, 32) does
