"""The pipelined forward on a GPU, first and alone: does it finish, is it right, how fast.

    PYTHONPATH=kernels python benchmarks/pipelined_check.py [--case 4096:64:16384]

Its programs wait on one another through counters, so a fault there would hang rather than
fail; ``benchmarks/gpu_kernels.sh`` runs this under a short timeout before anything else and
leaves the pipelined path out of the later steps unless it passes. Prints, for a few launch
sizes and lags, the error against the float64 reference and the time next to the
``three_kernel`` and ``chunked`` forwards (``triton.testing.do_bench`` medians); exits 1 if
any result is off.
"""

from __future__ import annotations

import argparse
import sys

import torch
from monarch_kernels import monarch_reference, triton_launch
from monarch_kernels.tune import _ms


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="4096:64:16384")
    args = parser.parse_args()
    n, blocks, B = (int(v) for v in args.case.split(":"))
    dev = torch.device("cuda")
    w = n // blocks
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, n, device=dev, dtype=torch.float64, generator=g)
    w1 = torch.randn(blocks, w, w, device=dev, dtype=torch.float64, generator=g) / w**0.5
    w2 = torch.randn(blocks, w, w, device=dev, dtype=torch.float64, generator=g) / w**0.5
    want = monarch_reference(x, w1, w2)
    xs, w1s, w2s = (t.bfloat16() for t in (x, w1, w2))
    sms = triton_launch._sm_count(dev)
    print(f"{torch.cuda.get_device_name(dev)}; n={n} blocks={blocks} batch={B} bfloat16")
    ok = True
    rows = []
    for lag, nprog in ((1, sms), (None, None), (None, 2 * sms), (None, 8 * sms)):
        triton_launch.PIPELINE_LAG = lag
        y = triton_launch.monarch_forward(xs, w1s, w2s, path="pipelined", num_programs=nprog)
        torch.cuda.synchronize()
        err = ((y.double() - want).norm() / want.norm()).item()
        ok &= bool(torch.isfinite(y).all()) and err < 2e-2
        ms = _ms(lambda lag=lag, p=nprog: _pipelined(xs, w1s, w2s, lag, p))
        rows.append((f"pipelined, lag {lag or 'chosen'}, {nprog or 'default'} programs", ms, err))
    triton_launch.PIPELINE_LAG = None
    for path in ("three_kernel", "chunked"):
        y = triton_launch.monarch_forward(xs, w1s, w2s, path=path)
        err = ((y.double() - want).norm() / want.norm()).item()
        ms = _ms(lambda p=path: triton_launch.monarch_forward(xs, w1s, w2s, path=p))
        rows.append((path, ms, err))
    for name, ms, err in rows:
        print(f"| {name:45} | {ms:.4f} ms | rel. error {err:.2e} |")
    print("pipelined check", "passed" if ok else "FAILED")
    return 0 if ok else 1


def _pipelined(x, w1, w2, lag, nprog):
    triton_launch.PIPELINE_LAG = lag
    return triton_launch.monarch_forward(x, w1, w2, path="pipelined", num_programs=nprog)


if __name__ == "__main__":
    sys.exit(main())
