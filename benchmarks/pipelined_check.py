"""The pipelined forward on a GPU, first and alone: does it finish, is it right, how fast.

    PYTHONPATH=kernels python benchmarks/pipelined_check.py [--case 4096:64:16384]

Its programs wait on one another through counters, so a fault there would hang rather than
fail; ``benchmarks/gpu_kernels.sh`` runs this under a short timeout before anything else and
leaves the pipelined path out of the later steps unless it passes. So that it stays short,
it compiles one config (the backend's first; the benchmark and probe tune them all). Prints,
for a few launch sizes and lags, with and without the kept intermediate, the error against
the float64 reference and the time (``triton.testing.do_bench`` medians); exits 1 if any
result is off. Without a GPU, under ``TRITON_INTERPRET=1``, it checks the same calls on the
CPU in float32 and times nothing.
"""

from __future__ import annotations

import argparse
import sys

import torch
from monarch_kernels import forward_launch, monarch_reference, pipeline_launch, triton_launch
from monarch_kernels.configs import get_configs
from monarch_kernels.tune import _ms


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="4096:64:16384")
    args = parser.parse_args()
    n, blocks, B = (int(v) for v in args.case.split(":"))
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    dtype, tol = (torch.bfloat16, 2e-2) if gpu else (torch.float32, 1e-5)
    w = n // blocks
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, n, device=dev, dtype=torch.float64, generator=g)
    w1 = torch.randn(blocks, w, w, device=dev, dtype=torch.float64, generator=g) / w**0.5
    w2 = torch.randn(blocks, w, w, device=dev, dtype=torch.float64, generator=g) / w**0.5
    want = monarch_reference(x, w1, w2)
    xs, w1s, w2s = (t.to(dtype) for t in (x, w1, w2))
    sms = triton_launch._sm_count(dev)
    name = torch.cuda.get_device_name(dev) if gpu else "CPU, Triton interpreter"
    print(f"{name}; n={n} blocks={blocks} batch={B} {str(dtype)[6:]}")
    ok = True
    rows = []
    first = {"pipeline": get_configs("pipeline")[0]}
    runs = [(1, sms, False), (None, None, False), (None, 8 * sms, False), (None, None, True)]
    for lag, nprog, keep in runs:

        def call(lag=lag, nprog=nprog, keep=keep):
            pipeline_launch.PIPELINE_LAG = lag
            return forward_launch.monarch_forward(
                xs, w1s, w2s, path="pipelined", configs=first, num_programs=nprog, keep=keep
            )

        y = call()[0] if keep else call()
        err = ((y.double() - want).norm() / want.norm()).item()
        ok &= bool(torch.isfinite(y).all()) and err < tol
        ms = _ms(call) if gpu else float("nan")
        kept = ", h kept" if keep else ""
        rows.append(
            (f"pipelined, lag {lag or 'chosen'}, {nprog or 'default'} programs{kept}", ms, err)
        )
    pipeline_launch.PIPELINE_LAG = None
    for what, ms, err in rows:
        print(f"| {what:50} | {ms:.4f} ms | rel. error {err:.2e} |")
    print("pipelined check", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
