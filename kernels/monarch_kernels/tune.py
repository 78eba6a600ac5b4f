"""Time every config of every kernel kind on one case, on a GPU: what autotuning chooses from.

    python -m monarch_kernels.tune --case 4096:64:16384 --dtype bfloat16

Rows: the forward and backward by stage config, the backward by weight-gradient config (the
other kind autotuned), then each path autotuned. Times are medians of
``triton.testing.do_bench``; ``%floor`` is the minimal traffic (x and y once; five
activations for the backward) at the bandwidth of a device-to-device copy measured in the
same run.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from . import triton_launch
from .configs import get_configs


def _ms(fn) -> float:
    if not torch.cuda.is_available():  # a smoke run under TRITON_INTERPRET=1
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << (28 if dev.type == "cuda" else 16), device=dev).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (_ms(lambda: dst.copy_(src)) * 1e-3)


def _fmt(cfg: triton.Config) -> str:
    kw = {k: v for k, v in cfg.kwargs.items() if k.startswith("BLOCK_")}
    dims = "/".join(f"{k[6:]}{v}" for k, v in kw.items())
    return f"{dims} w{cfg.num_warps} s{cfg.num_stages}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="4096:64:16384", help="n:blocks:batch")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kinds", default="stage,wgrad")
    args = parser.parse_args(argv)
    n, blocks, batch = (int(v) for v in args.case.split(":"))
    dtype = getattr(torch, args.dtype)
    bs = n // blocks
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(batch, n, device=dev, dtype=dtype)
    dy = torch.randn(batch, n, device=dev, dtype=dtype)
    w1 = torch.randn(blocks, bs, bs, device=dev, dtype=dtype) / bs**0.5
    w2 = torch.randn(blocks, bs, bs, device=dev, dtype=dtype) / bs**0.5
    bw = _copy_bandwidth(dev)
    floor = {
        "fwd": 2 * x.numel() * x.element_size() / bw,
        "bwd": 5 * x.numel() * x.element_size() / bw,
    }
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter)"
    print(f"{name}; case n={n} blocks={blocks} batch={batch} {args.dtype}")
    print(
        f"copy bandwidth {bw / 1e9:.0f} GB/s; floors fwd {floor['fwd'] * 1e3:.4f} ms, "
        f"bwd {floor['bwd'] * 1e3:.4f} ms"
    )
    rows = []

    def add(what, key, fn):
        try:
            ms = _ms(fn)
            rows.append((what, key, f"{ms:.4f}", f"{100 * floor[key] / (ms * 1e-3):.1f}"))
        except Exception as exc:  # a config the chip cannot run is reported, not fatal
            rows.append((what, key, type(exc).__name__, str(exc).splitlines()[0][:60]))

    fwd, bwd = triton_launch.monarch_forward, triton_launch.monarch_backward
    for kind in args.kinds.split(","):
        for cfg in get_configs(kind):
            c = {kind: cfg}
            if kind == "stage":
                add(
                    f"stage {_fmt(cfg)}",
                    "fwd",
                    lambda c=c: fwd(x, w1, w2, path="three_kernel", configs=c),
                )
            add(
                f"{kind} {_fmt(cfg)}",
                "bwd",
                lambda c=c: bwd(dy, x, w1, w2, path="three_kernel", configs=c),
            )
    for path in (*triton_launch.PATHS, None):
        add(f"autotuned, path {path or 'chosen'}", "fwd", lambda p=path: fwd(x, w1, w2, path=p))
        add(f"autotuned, path {path or 'chosen'}", "bwd", lambda p=path: bwd(dy, x, w1, w2, path=p))
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'kernel config'.ljust(width)} | pass | ms | %floor |")
    print(f"|{'-' * (width + 2)}|------|----|--------|")
    for what, key, ms, pct in rows:
        print(f"| {what.ljust(width)} | {key} | {ms} | {pct} |")


if __name__ == "__main__":
    main()
