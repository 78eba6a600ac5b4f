# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The launcher of the pipelined forward (``pipeline_kernel.py``): its ring of scratch slots,
the rounds between a tile's stages, and its configs, timed here."""

from __future__ import annotations

import torch
import triton

from . import replay
from . import triton_launch as launch
from .configs import get_configs
from .path_choice import _call_ms
from .pipeline_kernel import _zero_kernel
from .triton_launch import _BuildError, _cdiv, _pow2, _run, _signature

# rounds of work items between a row tile's stages in the pipelined forward; None: as many as
# the programs take at once, within half the shared cache (_pipeline_lag)
PIPELINE_LAG: int | None = None


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

    def start(cfg: triton.Config) -> None:
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
        launch._launch("pipeline", lambda meta: grid, args, cfg, **const)

    if config is None:
        key = ("pipeline", keep, *_signature(x2, w1, w2))
        untimed = launch.interpreting() or torch.cuda.is_current_stream_capturing()
        config = launch._tuned.get(key) or (get_configs("pipeline")[0] if untimed else None)
        if config is None:
            replay.spoil()  # the timing launches are not the call's
            config = launch._tuned[key] = _fastest(start, get_configs("pipeline"))
    start(config)
    return kept


def _pipeline_lag(nprog: int, per_round: int, slot_bytes: int, device: torch.device) -> int:
    """Rounds between a tile's stages: as many as ``nprog`` programs hold at once, so that an
    item's inputs were taken that many tickets earlier and are usually done; fewer where the
    ring of ``2*lag + 2`` slots would take more than half the shared cache (_cache_bytes)."""
    fits = (launch._cache_bytes(device) // 2 // slot_bytes - 2) // 2
    return max(1, min(_cdiv(nprog, per_round), fits))


def _blocks_per_item(nblk: int, width: int) -> int:
    """Blocks per stage item of the pipelined forward: 8, 4, 2 or 1, dividing the block
    count, about 512 outputs an item (one block where blocks are wider)."""
    return next(j for j in (8, 4, 2, 1) if nblk % j == 0 and j * width <= max(width, 512))


def _fastest(start, configs: list) -> triton.Config:
    """The config of ``configs`` whose ``start(config)`` runs fastest; those that do not build
    on this chip are skipped, as Triton's autotuner skips them."""
    times = {}
    for cfg in configs:
        try:
            start(cfg)  # compiles
        except (_BuildError, triton.OutOfResources):
            continue
        times[cfg] = min(_call_ms(lambda c=cfg: start(c), calls=3) for _ in range(3))
    if not times:
        raise RuntimeError("monarch_kernels: no pipelined config builds on this device")
    return min(times, key=times.get)
