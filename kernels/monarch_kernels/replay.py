"""Launch plans: a launcher's kernels replayed for a call it has seen before.

Most of a launcher's host time goes to deciding again what it decided on the last call with
the same arguments: checks, shape arithmetic, the path, strides, configs, grids and launch
keys. A plan keeps the outcome for one call signature (every input's shape, strides, dtype,
device and pointer alignment, and the options; the caller builds the key): the tensors the
launcher allocated, the kernels it launched with every argument, and which allocations it
returned. A later call with that signature allocates the same tensors and makes the same
launches, each pointer moved onto the new call's tensors. Nothing is computed differently: the
kernels, grids and arguments are those the launcher would pass, and the test compares them.

A plan is recorded on a signature's second call (the first chooses paths and autotunes) and
is kept only where the launcher did nothing but allocate, take views and launch through
``direct.launch``, and every pointer it passed lies inside one of the call's inputs or of its
own allocations. Every torch operation it makes is watched (a ``TorchDispatchMode``), so a
copy, a BLAS call or Triton's autotuner leaves the call unplanned; it is tried again a few
times, then run as before. Not recorded inside a CUDA-graph capture (the path choice is not
timed there); replayed there as anywhere.

Under Triton's interpreter and Triton older than 3.3 a plan's launches go through Triton's
own ``kernel[grid](...)`` with views rebuilt on the new tensors; plans are off under the
interpreter unless ``ENABLED`` is set (the tests do, to run replays), and
``MONARCH_KERNELS_PLANS=0`` turns them off.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import driver

ENV_VAR = "MONARCH_KERNELS_PLANS"
ENABLED: bool | None = None  # None: on for compiled kernels, off under the interpreter
MAX_TRIES = 3  # recordings that may fail for a signature before it is left unplanned
MAX_PLANS = 4096  # signatures hold exact sizes; a process cycling through many batch sizes
_plans: dict[tuple, Plan | int] = {}  # key -> plan, or how many calls have gone unplanned


class _State(threading.local):
    recorder: Recorder | None = None  # the recording running on this thread, if any


state = _State()
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}


def enabled(interpreting: bool) -> bool:
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    return (not interpreting) if ENABLED is None else ENABLED


def spoil() -> None:
    """Tell a recording running on this thread that this call cannot be repeated as recorded
    (Triton's autotuner launches past ``direct.launch``)."""
    if state.recorder is not None:
        state.recorder.spoiled = True


def call(key: tuple, inputs: Sequence[torch.Tensor], launcher: Callable):
    """``launcher()``, through the plan for ``key`` where there is one. ``inputs``: every
    tensor the launcher reads."""
    if state.recorder is not None:
        # a launcher called inside another's recording (the path choice's timing runs): its
        # launches would be taken for that call's
        state.recorder.spoiled = True
        return launcher()
    entry = _plans.get(key)
    if type(entry) is Plan:
        # launches go to the current device: a plan made for another runs as before
        here = entry.device is None or entry.device == _current_device()
        result = entry.replay(inputs) if here else None
        return launcher() if result is None else result
    calls = entry or 0
    if calls > MAX_TRIES or (inputs[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return launcher()
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = calls + 1
    if calls == 0:
        return launcher()  # the first call chooses paths and autotunes
    with Recorder(inputs) as rec:
        result = launcher()
    plan = rec.plan(result)
    if plan is not None:
        _plans[key] = plan
    return result


class Plan:
    """Allocations and launches to repeat on new inputs. Tensor slots are numbered inputs
    first, then allocations; a pointer is (slot, byte offset)."""

    def __init__(self, allocations, launches, results, single, device) -> None:
        self.allocations = allocations  # (shape, stride, dtype, offset from 16-byte alignment)
        self.launches = launches  # _Compiled or _Interpreted
        self.results = results  # slots
        self.single = single  # the launcher returned one tensor, not a tuple
        self.device = device

    def replay(self, inputs: Sequence[torch.Tensor]):
        """The launcher's result for ``inputs``; None, having launched nothing, where an
        allocation is aligned otherwise than when recorded (the compiled kernels were chosen
        for that alignment; torch's allocators give 512 bytes or more)."""
        device = inputs[0].device
        tensors = list(inputs)
        for shape, stride, dtype, align in self.allocations:
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if t.data_ptr() & 15 != align:
                return None
            tensors.append(t)
        for launch in self.launches:
            launch(tensors)
        if self.single:
            return tensors[self.results[0]]
        return tuple(tensors[i] for i in self.results)


class _Compiled:
    """One launch of a compiled kernel: ``runner(*args, stream=...)`` with the pointers (the
    leading arguments) rebased."""

    def __init__(self, runner, args: list, pointers: list[tuple[int, int]], device: int) -> None:
        self.runner = runner
        self.args = args  # the pointers' places hold the recorded values
        self.pointers = pointers  # (slot, byte offset) for args[0], args[1], ...
        self.device = device
        self.stream = driver.active.get_current_stream

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        args = self.args.copy()
        for i, (slot, offset) in enumerate(self.pointers):
            args[i] = tensors[slot].data_ptr() + offset
        self.runner(*args, stream=self.stream(self.device))


class _Interpreted:
    """One launch through Triton's own ``kernel[grid](...)``: each tensor argument rebuilt as
    the same view of the new call's slot."""

    def __init__(self, kernel, grid, args: list, views: list, constants: dict) -> None:
        self.kernel, self.grid, self.args, self.views = kernel, grid, args, views
        self.constants = constants

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        args = self.args.copy()
        for i, (slot, offset, size, stride) in self.views:
            base = tensors[slot]
            args[i] = base.as_strided(size, stride, base.storage_offset() + offset)
        self.kernel[self.grid](*args, **self.constants)


class Recorder(TorchDispatchMode):
    """Watches one launcher call: its allocations (kept), its views (allowed), any other torch
    operation (spoils the plan), and the launches ``direct.launch`` reports."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.inputs = list(inputs)
        self.allocated: list[torch.Tensor] = []
        self.launches: list[tuple] = []
        self.spoiled = _overlapping(self.inputs)
        self.paused = False

    def __enter__(self):
        state.recorder = self
        return super().__enter__()

    def __exit__(self, *exc):
        state.recorder = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:  # Triton's interpreter moving its arguments
            pass
        elif func in _ALLOCATIONS:
            self.allocated.append(out)
        elif not func.is_view:
            self.spoiled = True
        return out

    def compiled(self, runner, args: list, pointers: int, device: int) -> None:
        """``runner(*args)`` was launched; its first ``pointers`` arguments are addresses."""
        self.launches.append(("compiled", runner, args, pointers, device))

    def interpreted(self, kernel, grid, args: tuple, constants: dict) -> None:
        self.launches.append(("interpreted", kernel, grid, args, constants))

    def plan(self, result) -> Plan | None:
        """The plan this call makes, or None where it cannot be repeated."""
        if self.spoiled or not self.launches:
            return None
        devices = {launch[4] for launch in self.launches if launch[0] == "compiled"}
        if len(devices) > 1:
            return None
        device = devices.pop() if devices else None
        tensors = self.inputs + self.allocated
        spans = [_span(t) for t in tensors]
        launches = []
        for kind, *launch in self.launches:
            if kind == "compiled":
                runner, args, n, dev = launch
                pointers = [_slot(spans, p) for p in args[:n]]
                if None in pointers:
                    return None
                launches.append(_Compiled(runner, args, pointers, dev))
            else:
                kernel, grid, args, constants = launch
                views = []
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        where = _slot(spans, a.data_ptr())
                        if where is None or a.dtype != tensors[where[0]].dtype:
                            return None
                        slot, offset = where
                        elements = offset // a.element_size()
                        views.append((i, (slot, elements, tuple(a.shape), a.stride())))
                template = [None if isinstance(a, torch.Tensor) else a for a in args]
                launches.append(_Interpreted(kernel, grid, template, views, constants))
        single = isinstance(result, torch.Tensor)
        results = []
        for r in [result] if single else result:
            slot = next((i for i, a in enumerate(self.allocated) if a is r), None)
            if slot is None:
                return None  # not a fresh allocation of this call
            results.append(len(self.inputs) + slot)
        allocations = [
            (tuple(a.shape), a.stride(), a.dtype, a.data_ptr() & 15) for a in self.allocated
        ]
        return Plan(allocations, launches, results, single, device)


def _current_device() -> int:
    return driver.active.get_current_device()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte a tensor's elements occupy (strides are non-negative)."""
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + (extent if t.numel() else 0) * t.element_size()


def _slot(spans: list[tuple[int, int]], pointer: int) -> tuple[int, int] | None:
    for i, (start, end) in enumerate(spans):
        if start <= pointer < end:
            return i, pointer - start
    return None


def _overlapping(inputs: list[torch.Tensor]) -> bool:
    spans = sorted(_span(t) for t in inputs)
    return any(a[1] > b[0] for a, b in itertools.pairwise(spans))
