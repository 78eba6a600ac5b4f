# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Where the Monarch op's time goes on a GPU: each stage kernel alone, by layout.

    PYTHONPATH=kernels python benchmarks/gpu_stage_probe.py [--case 4096:64:16384]

Times (``triton.testing.do_bench`` medians) for one block-diagonal stage as the op launches
it: reading x and writing the feature-major intermediate (stage 1), and reading that and
writing y in the specification's permuted order (stage 2), next to stage 2 writing a
block-major buffer instead (coalesced along features); the blas path's two bmm calls and
its output permutation; cuBLAS bmm of a block-major stage and a plain copy for scale. Then
the host's cost: microseconds of Python and launch work per call at a batch small enough
that the device keeps up (each path, the public function (eager route) and the custom ops,
with and without autograd, one Triton launch, one bmm), with a cProfile of the op's calls
written to ``$OUT/host_profile_<n>_<blocks>.txt`` where OUT is set; then a torch.profiler
breakdown of the op's forward and backward, per kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time

import torch
from monarch_kernels import blas, monarch_matmul, triton_launch
from monarch_kernels.tune import _ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="4096:64:16384")
    args = parser.parse_args()
    paths = triton_launch.PATHS
    n, blocks, B = (int(v) for v in args.case.split(":"))
    bs = n // blocks
    k = l = blocks
    p = q = r = s = bs
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(B, n, device=dev, dtype=dt)
    w1 = torch.randn(k, q, p, device=dev, dtype=dt) / p**0.5
    w2 = torch.randn(l, s, r, device=dev, dtype=dt) / r**0.5
    h = torch.randn(k * q, B, device=dev, dtype=dt)
    y = torch.randn(B, n, device=dev, dtype=dt)
    act = B * n * x.element_size()
    rows = []

    def add(name, fn, traffic=2 * act):
        try:
            ms = _ms(fn)
        except Exception as err:  # a row that says so; the other rows still run
            print(f"{name}: failed: {type(err).__name__}: {str(err).strip()[:200]}")
            ms = float("nan")
        rows.append((name, ms, traffic / (ms * 1e-3) / 1e9))

    sx = (x.stride(0), p, 1)
    sw = (w1.stride(0), w1.stride(1), w1.stride(2))
    feature_major = (1, q * B, B)  # h[i*q + a, b]
    permuted_in = (1, B, l * B)  # h[rr*l + j, b]
    y_perm = (n, 1, l)  # y[b, a*l + j]
    y_block = (n, s, 1)  # y[b, j*s + a]

    def stage(inp, w, out, s_in, s_out):
        triton_launch._stage(inp, w, out, B, k, q, p, s_in, sw, s_out, None)

    add("stage 1: x -> h", lambda: stage(x, w1, h, sx, feature_major))
    add("stage 2: h -> y permuted", lambda: stage(h, w2, y, permuted_in, y_perm))
    add("stage 2: h -> y block-major", lambda: stage(h, w2, y, permuted_in, y_block))
    add("transpose rows (B, s*l) -> (B, l*s)", lambda: triton_launch._transpose_rows(y, s, l))
    xb = x.view(B, k, p).transpose(0, 1)
    out = torch.empty(k, B, q, device=dev, dtype=dt)
    add("cuBLAS bmm, block-major in and out", lambda: torch.bmm(xb, w1.transpose(1, 2), out=out))
    # the blas path's pieces: its two bmm calls (batch-last), then the output permutation
    ht = blas.stage_one(x, w1)
    add("blas stage 1: bmm x.T -> h.T", lambda: blas.stage_one(x, w1))
    add(
        "blas stage 2: bmm h.T -> (l, s, B)",
        lambda: torch.bmm(w2, ht.view(r, l, B).transpose(0, 1)),
    )
    yt = torch.empty(l, s, B, device=dev, dtype=dt)
    add("batch-last (l, s, B) -> y", lambda: triton_launch._batch_last(y, yt, l, s, to_flat=True))
    a, wd = torch.randn(B, bs, device=dev, dtype=dt), torch.randn(n, bs, device=dev, dtype=dt)
    add(f"dense GEMM of one stage's FLOPs ({B}x{bs} @ {bs}x{n})", lambda: torch.mm(a, wd.T))
    ycopy = torch.empty_like(y)
    add("copy y", lambda: ycopy.copy_(y))
    dy = torch.randn_like(y)
    for path in paths:
        add(f"op forward, {path}", lambda p=path: triton_launch.monarch_forward(x, w1, w2, path=p))
        add(
            f"op backward, {path}",
            lambda p=path: triton_launch.monarch_backward(dy, x, w1, w2, path=p),
            traffic=5 * act,
        )
    for path in paths:
        _y, hk = triton_launch.monarch_forward(x, w1, w2, path="three_kernel", keep=True)
        add(
            f"op backward, {path}, h kept",
            lambda p=path, hk=hk: triton_launch.monarch_backward(dy, x, w1, w2, path=p, h=hk),
            traffic=5 * act,
        )
    print(f"{torch.cuda.get_device_name(dev)}; n={n} blocks={blocks} batch={B} bfloat16")
    width = max(len(r[0]) for r in rows)
    print(f"| {'what'.ljust(width)} | ms | GB/s (activations moved) |")
    print(f"|{'-' * (width + 2)}|----|------|")
    for name, ms, gbs in rows:
        print(f"| {name.ljust(width)} | {ms:.4f} | {gbs:.0f} |")
    host_costs(w1, w2, paths)
    xg = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in (w1, w2)]
    for _ in range(3):
        monarch_matmul(xg, *ws).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            monarch_matmul(xg, *ws).backward(dy)
        torch.cuda.synchronize()
    events = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):
        try:
            print(events.table(sort_by=key, row_limit=12, max_name_column_width=60))
            break
        except (AttributeError, KeyError, ValueError):
            continue


def host_us(fn, calls: int = 300) -> float:
    """Microseconds of host work per call: calls issued back to back without synchronising,
    at a size where the device finishes each sooner than the host issues the next."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * issued / calls


def host_costs(w1: torch.Tensor, w2: torch.Tensor, paths, batch: int = 256) -> None:
    """The host's share: per-call microseconds of each path and of the pieces under it."""
    n = w1.shape[0] * w1.shape[2]
    l, s, _r = w2.shape
    x = torch.randn(batch, n, device=w1.device, dtype=w1.dtype)
    dy = torch.randn(batch, s * l, device=w1.device, dtype=w1.dtype)
    y = torch.empty_like(dy)
    yt = torch.empty(l, s, batch, device=w1.device, dtype=w1.dtype)
    xg = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in (w1, w2)]
    calls = {
        "one Triton launch (batch-last pass)": lambda: triton_launch._batch_last(
            y, yt, l, s, to_flat=True
        ),
        "one torch.bmm": lambda: torch.bmm(w2, yt),
        "monarch_matmul, no grad": lambda: monarch_matmul(x, w1, w2),
        "monarch_matmul forward, autograd": lambda: monarch_matmul(xg, *ws),
        "monarch_matmul forward+backward": lambda: monarch_matmul(xg, *ws).backward(dy),
        "the custom op (as compiled code calls it), no grad": lambda: (
            torch.ops.monarch_kernels.monarch_matmul(x, w1, w2)
        ),
        "the custom ops forward+backward": lambda: torch.ops.monarch_kernels.monarch_matmul_keep(
            xg, *ws
        )[0].backward(dy),
    }
    for path in paths:
        calls[f"launcher forward, {path}"] = lambda p=path: triton_launch.monarch_forward(
            x, w1, w2, path=p
        )
        calls[f"launcher backward, {path}"] = lambda p=path: triton_launch.monarch_backward(
            dy, x, w1, w2, path=p
        )
    print(f"\nhost microseconds per call, batch {batch} (the device keeps up)")
    width = max(map(len, calls))
    for name, fn in calls.items():
        with torch.no_grad() if "no grad" in name else contextlib.nullcontext():
            try:
                print(f"| {name.ljust(width)} | {host_us(fn):8.1f} |")
            except Exception as err:  # a row that says so
                print(f"| {name.ljust(width)} | failed: {type(err).__name__} |")
    prof = cProfile.Profile()
    fwd_bwd = calls["monarch_matmul forward+backward"]
    prof.enable()
    for _ in range(200):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    if os.environ.get("OUT"):
        name = f"host_profile_{n}_{w1.shape[0]}.txt"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
