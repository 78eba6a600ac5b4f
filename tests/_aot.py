"""Ahead-of-time compilation of the Triton kernels, as their launchers specialise them: no GPU.

Shared by the compile and codegen tests and ``benchmarks/kernel_registers.py``. Pointers are
16-byte aligned, as Triton's JIT specialises the tensors the launchers allocate; every other
argument is a run-time int32; the compiler options are those every launch passes.
"""

from __future__ import annotations

# The compile-time constants each kind's launcher adds at width 4096 with 64 blocks (besides a
# config's own): the stage kernel as it writes the batch-contiguous intermediates.
LAUNCH_CONSTANTS = {"stage": {"TRANS_OUT": True}, "wgrad": {}}
# what Triton takes as compiler options rather than kernel constants
_OPTION_KEYS = ("waves_per_eu", "matrix_instr_nonkdim")


def compile_ahead(kernel, constexprs: dict, options: dict, target, dtype: str = "bf16"):
    """``kernel`` compiled for ``target`` (backend, arch, warp size) with ``dtype`` tensors
    (float32 for weight-gradient partials)."""
    import triton
    from monarch_kernels.triton_launch import _OPTIONS
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"partial_ptr": "*fp32"}
    signature = {
        name: "constexpr"
        if name in constexprs
        else types.get(name, f"*{dtype}" if name.endswith("_ptr") else "i32")
        for name in kernel.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name.endswith("_ptr")
    }
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget(*target), options={**_OPTIONS, **options})


def compile_config(kind: str, cfg, target, dtype: str = "bf16", **constants):
    """Kind ``kind``'s kernel with config ``cfg`` as launched at width 4096 with 64 blocks,
    ``constants`` overriding the launcher's (``TRANS_OUT=False``, say)."""
    from monarch_kernels.triton_launch import _KERNELS

    constexprs = {**cfg.kwargs, **LAUNCH_CONSTANTS[kind], **constants}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    options.update({k: constexprs.pop(k) for k in _OPTION_KEYS if k in constexprs})
    return compile_ahead(_KERNELS[kind], constexprs, options, target, dtype)
