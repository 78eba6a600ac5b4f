"""A stand-in for the GPU driver Triton launches through, on a machine without a GPU.

Triton's JIT compiles for the target its active driver names and hands the compiled kernel to
that driver's launcher. This driver names an sm_90 GPU (H100/H200) and its launcher records
what it is handed instead of launching. Everything above it (our launchers, Triton's
specialisation, compilation and caches) is the real code. Used by ``test_monarch_launch.py``
and by ``benchmarks/launch_host.py``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from triton.backends.compiler import GPUTarget
from triton.runtime import driver

H200_SMS = 132
H200_SHARED = 232448  # bytes of shared memory a block may use


class RecordingLauncher:
    """What Triton's CUDA launcher is called with, appended to ``calls``."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __call__(self, *launch) -> None:
        self.calls.append(launch)


class _Utils:
    def get_device_properties(self, device) -> dict:
        return {"max_shared_mem": H200_SHARED, "multiprocessor_count": H200_SMS}

    def load_binary(self, name, binary, shared, device):
        # (module, function, registers, spills, max threads); the function names the binary,
        # so a launch says which compiled variant it runs
        return ("module", name), (name, hash(binary)), 64, 0, 1024

    def unload_module(self, module) -> None:
        pass


class FakeCudaDriver:
    """Triton's driver interface for one sm_90 device whose launches are recorded."""

    def __init__(self) -> None:
        self.calls: list = []
        self.utils = _Utils()

    def launcher_cls(self, src, metadata) -> RecordingLauncher:
        return RecordingLauncher(self.calls)

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device) -> int:
        return 7  # any handle; the launcher must receive this one

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def fake_gpu():
    """The fake driver active, with fresh JIT, direct-launch and launch-plan caches for our
    kernels (their compiled-for-sm_90 entries are dropped again on exit)."""
    from monarch_kernels import direct, replay, triton_kernels
    from triton.runtime.jit import JITFunction

    kernels = [k for k in vars(triton_kernels).values() if isinstance(k, JITFunction)]
    saved = driver._active, direct._compiled, direct._pointers, replay._plans
    saved_caches = [k.device_caches for k in kernels]
    fake = FakeCudaDriver()
    driver._active = fake
    direct._compiled, direct._pointers, replay._plans = {}, {}, {}
    for k in kernels:
        k.device_caches = defaultdict(k.create_binder)
    try:
        yield fake
    finally:
        for k, caches in zip(kernels, saved_caches, strict=True):
            for kernel_cache, *_ in k.device_caches.values():
                for compiled in kernel_cache.values():
                    compiled.module = None  # loaded by this driver: nothing for the real one
            k.device_caches = caches
        driver._active, direct._compiled, direct._pointers, replay._plans = saved
