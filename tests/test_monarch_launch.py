"""Direct launches (``monarch_kernels/direct.py``): the GPU's launcher must receive exactly what
Triton's own launch path gives it, and a launch must run the variant Triton compiled for its
arguments.

Without a GPU, Triton's driver is the stand-in (``_fake_triton_driver.py``): it names an sm_90
target and records each launch. Our launchers, Triton's specialisation, compilation and
caches are the real code; the kernels are compiled, not run.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"
)


def _summary(call: tuple) -> tuple:
    """A launcher call with each tensor as what identifies its use (dtype, shape, strides) and
    the launch metadata for the profiling hooks as its contents."""
    import torch
    from triton.compiler.compiler import LazyDict

    def summary(a):
        if isinstance(a, torch.Tensor):
            return a.dtype, tuple(a.shape), a.stride(), a.storage_offset()
        if isinstance(a, LazyDict):
            return a.data, len(a.extras)
        return a

    return tuple(map(summary, call))


def _step(monkeypatch, nblocks: int, path: str):
    """Forward and backward of ``path`` at width 4096 (bfloat16, batch 256) on CPU tensors:
    the launchers' checks let them through as they do under the interpreter."""
    import torch
    from monarch_kernels import triton_launch

    monkeypatch.setattr(triton_launch, "interpreting", lambda: True)
    g = torch.Generator().manual_seed(0)
    B, n, w = 256, 4096, 4096 // nblocks
    x = torch.randn(B, n, generator=g).bfloat16()
    dy = torch.randn(B, n, generator=g).bfloat16()
    w1 = torch.randn(nblocks, w, w, generator=g).bfloat16()
    w2 = torch.randn(nblocks, w, w, generator=g).bfloat16()
    keep = path != "fused"
    out = triton_launch.monarch_forward(x, w1, w2, path=path, keep=keep)
    h = out[1] if keep else None
    triton_launch.monarch_backward(dy, x, w1, w2, path=path, h=h)


@pytest.mark.parametrize("nblocks", [64, 4])
def test_direct_launches_hand_the_launcher_what_triton_would(monkeypatch, nblocks):
    from _fake_triton_driver import fake_gpu
    from monarch_kernels import direct, triton_launch

    paths = triton_launch.PATHS if nblocks == 64 else ("two_kernel", "three_kernel")
    for path in paths:
        with fake_gpu() as gpu:
            monkeypatch.setattr(direct, "SUPPORTED", False)  # Triton's JIT launches
            _step(monkeypatch, nblocks, path)
            through_triton = [_summary(c) for c in gpu.calls]
            monkeypatch.setattr(direct, "SUPPORTED", True)
            gpu.calls.clear()
            _step(monkeypatch, nblocks, path)
            direct_calls = [_summary(c) for c in gpu.calls]
            entries = len(direct._compiled)
            gpu.calls.clear()
            _step(monkeypatch, nblocks, path)  # now every launch is a cache hit
            assert len(direct._compiled) == entries
            again = [_summary(c) for c in gpu.calls]
        assert len(through_triton) >= 3, path
        assert direct_calls == through_triton, path
        assert again == through_triton, path
        assert all(call[3] == 7 for call in direct_calls)  # the current stream


def test_direct_launch_runs_the_variant_compiled_for_the_alignment():
    """Triton specialises a pointer on 16-byte alignment and on nothing finer (what the key
    relies on): a misaligned buffer gets its own compiled variant, a 16- but not 32-byte
    aligned one shares the aligned one's."""
    import torch
    from _fake_triton_driver import fake_gpu
    from monarch_kernels import direct
    from monarch_kernels.triton_kernels import _sum_splits_kernel

    n, splits = 4096, 3
    storage = torch.zeros(splits * n + 64)
    base = (-storage.data_ptr() % 32) // 4  # 32-byte aligned start
    out1, out2 = torch.empty(n), torch.empty(n)

    def run(offset: int):
        buf = storage[base + offset : base + offset + splits * n].view(splits, n)
        args = (buf, out1, out2, n // 2, n, splits, n)
        const = {"BLOCK": 1024, "enable_fp_fusion": True}
        grid = (n // 1024,)
        compiled = _sum_splits_kernel.run(*args, grid=grid, warmup=True, **const)
        gpu.calls.clear()
        direct.launch(_sum_splits_kernel, grid, args, const)
        (call,) = gpu.calls
        return compiled, call[4]  # the function the launcher ran

    with fake_gpu() as gpu:
        aligned, f_aligned = run(0)
        sixteen, f_sixteen = run(4)  # 16 bytes on: aligned to 16, not to 32
        odd, f_odd = run(1)  # 4 bytes on
    assert sixteen is aligned and f_sixteen == f_aligned == aligned.function
    assert odd is not aligned and f_odd == odd.function != f_aligned


def test_launch_host_benchmark_prints_both_paths():
    """``benchmarks/launch_host.py`` without a GPU: each row times both launch paths."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "tests")}
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks/launch_host.py"), "--batch", "64", "--calls", "5"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Triton's driver stubbed" in proc.stdout
    rows = [r for r in proc.stdout.splitlines() if r.startswith("| ") and "Triton JIT" not in r]
    assert len(rows) == 6
    for row in rows:
        _name, jit, fast, saved = (c.strip() for c in row.strip("|").split("|"))
        assert float(jit) > 0 and float(fast) > 0 and saved.endswith("%")
