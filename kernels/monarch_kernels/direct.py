"""Direct launches of compiled Triton kernels: Triton's per-call argument work done once.

``kernel[grid](*args)`` binds and specialises every argument, builds and looks up a cache-key
string and reads the current device, stream and launch hooks on every call. ``launch`` keys a
call on what the compiled code can depend on (each tensor's dtype and its data pointer's
offset from 16-byte alignment, every other argument's value, the constants and compiler
options), asks Triton once per key for the kernel it would launch (``run(..., warmup=True)``:
its own specialisation, compilation and caches) and from then on hands the arguments straight
to that compiled kernel's launcher, as Triton's JIT does last. Exact integer values make the
key at least as fine as Triton's integer specialisation (divisibility by 16, equality with 1);
``tests/test_monarch_launch.py`` checks that 16-byte alignment is all Triton reads of a tensor
beyond its dtype, and that the launcher receives the very arguments the JIT would give it.
Tensors are handed to the launcher as their addresses, which it takes as they are; given a
tensor, it calls ``data_ptr()`` and asks the driver whether that is a device pointer
(``cuPointerGetAttribute``, ``hipPointerGetAttribute``), on every launch, for every tensor.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from . import replay

# From Triton 3.3 the launcher takes every argument, constexprs included, in the kernel's
# order; before, the JIT dropped the constexprs first. Older versions keep Triton's own path.
SUPPORTED = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 3)
MAX_ENTRIES = 4096  # keys hold exact sizes; a process cycling through many batch sizes
_compiled: dict[tuple, tuple] = {}  # key -> (compiled kernel, the arguments after ``args``)
_pointers: dict[int, int] = {}  # id(kernel) -> how many leading arguments are tensors


def launch(kernel, grid: tuple[int, ...], args: tuple, constants: dict) -> None:
    """``kernel[grid](*args, **constants)``: ``args`` the non-constexpr parameters in order,
    tensors first (as every kernel here takes them), ``constants`` the constexprs and compiler
    options by name. Under the interpreter (and on Triton before 3.3), Triton's own launch.
    A launch plan being recorded (``replay.py``) is told what was launched."""
    rec = replay.state.recorder
    if not SUPPORTED or not isinstance(kernel, JITFunction):
        if rec is None:
            kernel[grid](*args, **constants)
            return
        rec.paused = True  # the interpreter's own copies are not the launcher's operations
        try:
            kernel[grid](*args, **constants)
        finally:
            rec.paused = False
        rec.interpreted(kernel, grid, args, constants)
        return
    n = _pointers.get(id(kernel))
    if n is None:
        n = _pointers[id(kernel)] = _leading_tensors(kernel, args)
    device = driver.active.get_current_device()
    tensors = args[:n]
    pointers = [t.data_ptr() for t in tensors]
    key = (
        id(kernel),
        device,
        args[n:],
        tuple(constants.items()),
        *[t.dtype for t in tensors],
        *[p & 15 for p in pointers],  # the offset from 16-byte alignment
    )
    entry = _compiled.get(key)
    if entry is None:
        entry = _compile(kernel, grid, args, constants)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = entry
    compiled, tail = entry
    # Addresses rather than tensors: the launcher would call each tensor's data_ptr() and ask
    # the driver to confirm it is a device pointer (cuPointerGetAttribute); the launchers have
    # checked that the tensors are on the GPU.
    launch_args = [*pointers, *args[n:], *tail]
    runner = compiled[(*grid, 1, 1)[:3]]
    runner(*launch_args, stream=driver.active.get_current_stream(device))
    if rec is not None:
        rec.compiled(runner, launch_args, n, device)


def _leading_tensors(kernel, args: tuple) -> int:
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    if any(isinstance(a, torch.Tensor) for a in args[n:]):
        raise TypeError(f"{kernel.fn.__name__}: tensor arguments must come first")
    return n


def _compile(kernel, grid, args, constants) -> tuple:
    """The compiled kernel Triton's JIT would launch for these arguments, and the values of
    the parameters after ``args`` (constexprs given or defaulted) in the kernel's order."""
    compiled = kernel.run(*args, grid=grid, warmup=True, **constants)
    if hasattr(compiled, "result"):  # Triton's asynchronous compilation mode
        compiled = compiled.result()
    tail = []
    for name in kernel.arg_names[len(args) :]:
        default = kernel.signature.parameters[name].default
        if name not in constants and default is inspect.Parameter.empty:
            raise TypeError(f"{kernel.fn.__name__}: no value for {name}")
        tail.append(constants.get(name, default))
    return compiled, tuple(tail)
