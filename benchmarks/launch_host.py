# ruff: noqa: E741
# (l is a block count, as in the specification.)
"""Host time of the Monarch op's launches: Triton's JIT launch, direct launches, launch plans.

    PYTHONPATH=kernels:tests python benchmarks/launch_host.py [--blocks 64] [--batch 256]

Microseconds of host work per call, for one launch, each launcher and a training step's
forward and backward through autograd, measured in the same run, alternating rounds, the
fastest of each kept, three ways: every launch through ``kernel[grid](...)`` (Triton's JIT:
binding, specialisation and a cache key per call); through ``monarch_kernels.direct`` (that
work once per argument kind); and with launch plans (``monarch_kernels.replay``: a launcher
call like one seen before repeats its recorded launches, skipping the launcher's own checks,
choices and arithmetic; "one launch" is no launcher call, so it has no plan). Last, the
same training step through a ``torch.autograd.Function`` that launches nothing: the part of
the step that is torch's (autograd, and on a GPU its hand-off to the device's thread).

On a GPU the launches are real, at a batch small enough that the device keeps up. Without
one, Triton's driver is ``tests/_fake_triton_driver.py``: the kernels are compiled for sm_90
and each launch is recorded instead of run, so the numbers are the host's work above the
driver (our launchers and Triton's argument handling), without the driver's own launch call,
and with CPU allocations in place of the CUDA caching allocator.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from monarch_kernels import (
    backward_launch,
    direct,
    forward_launch,
    monarch_matmul,
    ops,
    replay,
    triton_launch,
)


def _us(fn, calls: int, rounds: int = 5) -> list[float]:
    """Per-call microseconds of ``fn`` issued back to back, one figure per round."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(1e6 * (time.perf_counter() - start) / calls)
    sync()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    stack = contextlib.ExitStack()
    if torch.cuda.is_available():
        device, where = "cuda", torch.cuda.get_device_name()
    else:
        from _fake_triton_driver import fake_gpu

        gpu = stack.enter_context(fake_gpu())
        device, where = "cpu", "no GPU: Triton's driver stubbed (sm_90), launches recorded"
        triton_launch.interpreting = lambda: True  # CPU tensors through the checks
        ops._use_triton = lambda device: True
        # the fake launcher keeps every call; drop them as they come
        gpu.calls = _Discard()
    l, w, B = args.blocks, args.width // args.blocks, args.batch
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(B, args.width, generator=g).bfloat16().to(device) for _ in range(2))
    w1, w2 = (
        torch.randn(l, w, w, generator=g).bfloat16().to(device).requires_grad_() for _ in range(2)
    )
    xg = x.detach().requires_grad_()

    def step():
        w1.grad = w2.grad = xg.grad = None
        monarch_matmul(xg, w1, w2).backward(dy)

    calls = {
        "one launch (row transpose)": lambda: triton_launch._transpose_rows(x, l, w),
    }
    for path in ("two_kernel", "three_kernel"):
        calls[f"launcher forward, {path}"] = lambda p=path: forward_launch.monarch_forward(
            x, w1, w2, path=p
        )
        calls[f"launcher backward, {path}"] = lambda p=path: backward_launch.monarch_backward(
            dy, x, w1, w2, path=p
        )
    # the chunked path at its most launches: 16 chunks (an L2 cache too small for more rows)
    for name, fn in (
        ("launcher forward, chunked, 16 chunks", lambda: forward_launch.monarch_forward(
            x, w1, w2, path="chunked"
        )),
        ("launcher backward, chunked, 16 chunks", lambda: backward_launch.monarch_backward(
            dy, x, w1, w2, path="chunked"
        )),
    ):  # fmt: skip
        calls[name] = _in_sixteen_chunks(fn)
    calls["forward+backward through autograd (chosen paths)"] = step
    print(f"host microseconds per call; width {args.width}, {l} blocks, batch {B}, bfloat16")
    print(f"device: {where}; torch {torch.__version__}\n")
    width = max(map(len, calls))
    print(f"| {'call'.ljust(width)} | Triton JIT | direct | planned | saved |")
    print(f"|{'-' * (width + 2)}|-----------:|-------:|--------:|------:|")
    if not direct.SUPPORTED:
        print("(this Triton is older than 3.3: every launch goes through its JIT)")
    modes = {"jit": (False, False), "direct": (True, False), "planned": (True, True)}
    if not direct.SUPPORTED:
        modes = {"jit": (False, False), "planned": (False, True)}
    saved = direct.SUPPORTED, replay.ENABLED
    for name, fn in calls.items():
        best = {}
        for _ in range(3):  # alternate, fastest of each
            for mode, (direct_launches, plans) in modes.items():
                direct.SUPPORTED, replay.ENABLED = direct_launches, plans
                best[mode] = min(best.get(mode, float("inf")), *_us(fn, args.calls))
        jit, fast, plan = (best.get(m, float("nan")) for m in ("jit", "direct", "planned"))
        print(
            f"| {name.ljust(width)} | {jit:10.1f} | {fast:6.1f} | {plan:7.1f} "
            f"| {1 - plan / jit:5.0%} |"
        )
    direct.SUPPORTED, replay.ENABLED = saved
    floor = min(_us(lambda: _nothing_step(xg, w1, w2, dy), args.calls))
    print(
        f"\nthe same step through a torch.autograd.Function that launches nothing "
        f"(torch's share): {floor:.1f}"
    )
    stack.close()


def _in_sixteen_chunks(fn):
    """``fn`` with the chunked path's chunk size as from an L2 cache that holds no row: the
    batch in ``MAX_CHUNKS`` (16) chunks."""

    def call():
        l2_bytes = triton_launch._cache_bytes
        triton_launch._cache_bytes = lambda device: 0
        try:
            return fn()
        finally:
            triton_launch._cache_bytes = l2_bytes

    return call


class _Nothing(torch.autograd.Function):
    """Saves what the op saves and returns fresh tensors of its outputs' shapes."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        ctx.save_for_backward(x, w1, w2)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2 = ctx.saved_tensors
        return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _nothing_step(x, w1, w2, dy) -> None:
    w1.grad = w2.grad = x.grad = None
    _Nothing.apply(x, w1, w2).backward(dy)


class _Discard(list):
    def append(self, item) -> None:
        pass


if __name__ == "__main__":
    main()
