"""Direct launches (``monarch_kernels/direct.py``) and launch plans (``replay.py``): the GPU's
launcher must receive exactly what Triton's own launch path gives it, a launch must run the
variant Triton compiled for its arguments, and a replayed call must make the launchers' own
launches on its own tensors.

Without a GPU, Triton's driver is the stand-in (``_fake_triton_driver.py``): it names an sm_90
target and records each launch. Our launchers, Triton's specialisation, compilation and
caches are the real code; the kernels are compiled, not run. (Replays' results are checked
under the interpreter, ``test_monarch_triton.py``, and on a GPU, ``test_monarch_gpu.py``.)
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"
)


def _summaries(calls: list, names: dict[int, str]) -> list[tuple]:
    """The launcher calls of one step, each pointer (a tensor, or the address direct launches
    pass) as the name of the step's input or output it points to (``names``: address ->
    name), other addresses numbered in order of first use, and the launch metadata for the
    profiling hooks as its contents."""
    import torch
    from triton.compiler.compiler import LazyDict

    labels = dict(names)

    def summary(a):
        if isinstance(a, torch.Tensor):
            a = a.data_ptr()
        if isinstance(a, int) and a >= 2**32:  # an address: sizes and strides are smaller
            return labels.setdefault(a, f"buffer {len(labels) - len(names)}")
        if isinstance(a, LazyDict):
            return a.data, len(a.extras)
        return a

    return [tuple(map(summary, call)) for call in calls]


def _step(monkeypatch, nblocks: int, path: str, seed: int = 0) -> dict[int, str]:
    """Forward and backward of ``path`` at width 4096 (bfloat16, batch 256) on CPU tensors:
    the launchers' checks let them through as they do under the interpreter. Returns the
    step's inputs and outputs by address."""
    import torch
    from monarch_kernels import backward_launch, forward_launch, triton_launch

    monkeypatch.setattr(triton_launch, "interpreting", lambda: True)
    g = torch.Generator().manual_seed(seed)
    B, n, w = 256, 4096, 4096 // nblocks
    x = torch.randn(B, n, generator=g).bfloat16()
    dy = torch.randn(B, n, generator=g).bfloat16()
    w1 = torch.randn(nblocks, w, w, generator=g).bfloat16()
    w2 = torch.randn(nblocks, w, w, generator=g).bfloat16()
    keep = path != "fused"  # it keeps no whole intermediate
    with _KeepAlive():  # no address reused within the step: a pointer names one tensor
        out = forward_launch.monarch_forward(x, w1, w2, path=path, keep=keep)
        y, h = out if keep else (out, None)
        dx, dw1, dw2 = backward_launch.monarch_backward(dy, x, w1, w2, path=path, h=h)
    named = {"x": x, "dy": dy, "w1": w1, "w2": w2, "y": y, "h": h, "dx": dx, "dw1": dw1}
    named["dw2"] = dw2
    return {t.data_ptr(): name for name, t in named.items() if t is not None}


class _KeepAlive:
    """Holds every tensor made inside it until it exits."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        held = self.held = []

        class Hold(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                held.append(out)
                return out

        self.mode = Hold()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.held.clear()


def _paths(nblocks: int) -> tuple[str, ...]:
    from monarch_kernels import triton_launch

    return triton_launch.PATHS if nblocks == 64 else ("two_kernel", "three_kernel")


@pytest.mark.parametrize("nblocks", [64, 4])
def test_direct_launches_hand_the_launcher_what_triton_would(monkeypatch, nblocks):
    from _fake_triton_driver import fake_gpu
    from monarch_kernels import direct, replay

    monkeypatch.setattr(replay, "ENABLED", False)  # every call through the launchers
    for path in _paths(nblocks):
        with fake_gpu() as gpu:
            monkeypatch.setattr(direct, "SUPPORTED", False)  # Triton's JIT launches
            names = _step(monkeypatch, nblocks, path)
            through_triton = _summaries(gpu.calls, names)
            monkeypatch.setattr(direct, "SUPPORTED", True)
            gpu.calls.clear()
            names = _step(monkeypatch, nblocks, path)
            direct_calls = _summaries(gpu.calls, names)
            entries = len(direct._compiled)
            gpu.calls.clear()
            names = _step(monkeypatch, nblocks, path)  # now every launch is a cache hit
            assert len(direct._compiled) == entries
            again = _summaries(gpu.calls, names)
        assert len(through_triton) >= 3, path
        assert direct_calls == through_triton, path
        assert again == through_triton, path
        assert all(call[3] == 7 for call in direct_calls)  # the current stream
        # the results are written where the step's outputs are (blas: dx by torch's BLAS)
        written = {a for call in direct_calls for a in call if isinstance(a, str)}
        assert {"y", "dw1", "dw2"} | (set() if path == "blas" else {"dx"}) <= written, path


@pytest.mark.parametrize("nblocks", [64, 4])
def test_launch_plans_repeat_the_launchers_launches(monkeypatch, nblocks, replays):
    """From a signature's third call the launchers' launches come from a plan
    (``replay.py``): the launcher must receive what the launchers themselves give it, with
    every pointer on the new call's tensors."""
    from _fake_triton_driver import fake_gpu
    from monarch_kernels import replay

    for path in _paths(nblocks):
        with fake_gpu() as gpu:
            monkeypatch.setattr(replay, "ENABLED", False)
            names = _step(monkeypatch, nblocks, path)
            unplanned = _summaries(gpu.calls, names)
            monkeypatch.setattr(replay, "ENABLED", True)
            planned = []
            for seed in range(4):  # seen, recorded, replayed twice
                gpu.calls.clear()
                replays.clear()
                names = _step(monkeypatch, nblocks, path, seed=seed)
                planned.append(_summaries(gpu.calls, names))
                # the blas path calls torch's BLAS, which a plan cannot repeat
                replayed = 2 if seed >= 2 and path != "blas" else 0
                assert len(replays) == replayed, (path, seed)
        assert len(unplanned) >= 3, path
        assert all(calls == unplanned for calls in planned), path


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


def test_launch_host_benchmark_prints_every_way():
    """``benchmarks/launch_host.py`` without a GPU: each row times Triton's JIT, direct
    launches and launch plans."""
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
    assert len(rows) == 8
    for row in rows:
        _name, jit, fast, planned, saved = (c.strip() for c in row.strip("|").split("|"))
        assert float(jit) > 0 and float(fast) > 0 and float(planned) > 0
        assert saved.endswith("%")
    assert "launches nothing (torch's share)" in proc.stdout
