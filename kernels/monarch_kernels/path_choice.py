"""The timed choice of a path: each direction's candidates run once per shape, the fastest
is kept (as Triton's autotuner keeps a config)."""

from __future__ import annotations

import time
import warnings

import torch
import triton

from .triton_launch import PATH_ENV_VAR, _BuildError

_path_choice: dict[tuple, str] = {}  # (direction, shapes, strides, dtype, device) -> path


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
