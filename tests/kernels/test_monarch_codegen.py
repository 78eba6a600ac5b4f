"""What the Triton kernels compile to, read without a GPU: their global memory accesses.

Each launch the launchers make at width 4096 with 64 and with 4 blocks (both paths, forward and
backward) is compiled ahead of time for sm_90 and gfx942 with the specialisation Triton's JIT
gives those arguments (pointers and integers divisible by 16, integers equal to 1 folded), and
its assembly must move bfloat16 data in vectors: an access of one 16-bit element per
instruction is what an unknown alignment or a result tile stored across its columns compiles
to, and costs a multiple of the memory transactions. The launches are recorded, not run.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"
)

# one 16-bit element per global access: PTX and AMDGCN spellings
SCALAR_16BIT = {
    "cuda": re.compile(r"\b(?:ld|st)\.global(?:\.[a-z0-9:]+)*\.(?:b16|u16|s16)\b"),
    "hip": re.compile(r"\b(?:global|buffer)_(?:load|store)_(?:short|ushort|sshort)\w*"),
}
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
TYPES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.int32": "i32"}


def _record_launches(monkeypatch, nblocks: int):
    """(kernel, args, kwargs) of every launch of the forward and backward on each path at
    width 4096, recorded from the real launchers (the kernels are not run)."""
    import torch
    from monarch_kernels import triton_launch

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    def launch(kind, grid, args, config, **const):
        launches.append((triton_launch._KERNELS[kind], args, {**const, "config": config}))

    monkeypatch.setattr(triton_launch, "_launch", launch)
    for name in ("_batch_last_kernel", "_transpose_rows_kernel", "_sum_splits_kernel"):
        monkeypatch.setattr(triton_launch, name, Recorder(getattr(triton_launch, name)))
    monkeypatch.setattr(triton_launch, "interpreting", lambda: True)  # CPU tensors pass checks
    # The blas path's block products (blas.py, torch.bmm) are not launches: their shapes only.
    # Computed, they are minutes of bfloat16 GEMM on a CPU without bfloat16 instructions.
    monkeypatch.setattr(torch, "bmm", _bmm_shape)
    monkeypatch.setattr(triton_launch, "_sm_count", lambda device: 132)  # an H200's split count
    B, n, width = 16384, 4096, 4096 // nblocks  # (empty tensors: nothing is computed)
    x = torch.empty(B, n, dtype=torch.bfloat16)
    dy = torch.empty(B, n, dtype=torch.bfloat16)
    w1 = torch.empty(nblocks, width, width, dtype=torch.bfloat16)
    w2 = torch.empty(nblocks, width, width, dtype=torch.bfloat16)
    for path in triton_launch.PATHS:
        _y, h = triton_launch.monarch_forward(x, w1, w2, path=path, keep=True)
        triton_launch.monarch_backward(dy, x, w1, w2, path=path, h=h)
        triton_launch.monarch_backward(dy, x, w1, w2, path=path)  # stage 1 recomputed
    return launches


def _bmm_shape(a, b, *, out=None):
    """``torch.bmm``'s result, its values left as they are: ``out``, or a new tensor."""
    import torch

    assert a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if out is None:
        return torch.empty(shape, dtype=a.dtype)
    assert tuple(out.shape) == shape and out.dtype == a.dtype
    return out


def _specialise(kernel, args, kwargs, config):
    """Signature, constants and attributes as Triton's JIT derives them from the values."""
    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
    values.update(config.kwargs if config else {})
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params, strict=True)):
        value = values.get(name, param.default)
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif hasattr(value, "data_ptr"):
            signature[name] = "*" + TYPES[str(value.dtype)]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _configs(backend: str, kind_kernel) -> list:
    from monarch_kernels import triton_launch
    from monarch_kernels.configs import _cuda_configs, _hip_configs

    kind = next(k for k, v in triton_launch._KERNELS.items() if v is kind_kernel)
    return _cuda_configs(kind) if backend == "cuda" else _hip_configs(kind, arch="gfx942")


@pytest.mark.parametrize("nblocks", [64, 4])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kernels_move_bfloat16_in_vectors(monkeypatch, target, nblocks):
    from monarch_kernels import triton_launch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp = TARGETS[target]
    seen, compiled = set(), 0
    for kernel, args, kwargs in _record_launches(monkeypatch, nblocks):
        if kernel is triton_launch._sum_splits_kernel.kernel:
            continue  # its output splits at the first weight's size: any alignment
        config = kwargs.get("config")
        if config is None and kernel in triton_launch._KERNELS.values():
            config = _configs(backend, kernel)[0]
        signature, constexprs, attrs = _specialise(kernel, args, kwargs, config)
        key = (kernel.__name__, str(signature), str(constexprs), str(attrs))
        if key in seen:
            continue
        seen.add(key)
        options = dict(triton_launch._OPTIONS)
        if config is not None:
            options.update(num_warps=config.num_warps, num_stages=config.num_stages)
            options.update({k: v for k, v in config.kwargs.items() if k not in kernel.arg_names})
        src = ASTSource(kernel, signature, constexprs, attrs)
        binary = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
        asm = binary.asm["ptx" if backend == "cuda" else "amdgcn"]
        scalar = SCALAR_16BIT[backend].findall(asm)
        assert not scalar, (kernel.__name__, constexprs, sorted(set(scalar)))
        compiled += 1
    assert compiled >= 5  # stage (both orientations), transposes, wgrad, batch-last
