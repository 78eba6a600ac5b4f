"""A cell run under torch.profiler on this rank (``%%monarch --profile``).

The steps are the optimizer's: a global optimizer step post hook advances the profiler, so a
training loop needs no change, and a cell without an optimizer step is one step, recorded
whole. The schedule is torch's idea with our counts: ``wait`` steps not recorded, then
``warmup`` recorded and marked (the notebook draws them and leaves them out of its numbers:
the profiler's own start-up lands there), then ``active`` recorded and measured; after those the
profiler stops, so the rest of a long loop runs at full speed.

At the cell's end, failed or not, the trace is written (not in the loop, at the last recorded
step, where torch would write it) and goes to the notebook as one ``profile`` event,
gzipped, ahead of the cell's end; one over MAX_TRACE_BYTES stays in a file on the rank, and the
event says where.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tempfile
import threading
from typing import Any

MAX_TRACE_BYTES = 64 * 2**20  # gzipped: what one rank sends back at most


def schedule(spec: dict[str, int]):
    """torch.profiler's schedule for ``spec``: NONE, then RECORD for warm-up and active steps,
    saved at the last. Not ``torch.profiler.schedule``: its warm-up steps are not recorded, and
    a cell that ends in them (one without an optimizer step) would leave no trace at all."""
    from torch.profiler import ProfilerAction

    first, last = spec["wait"], spec["wait"] + spec["warmup"] + spec["active"] - 1

    def action(step: int) -> ProfilerAction:
        if step < first or step > last:
            return ProfilerAction.NONE
        return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.RECORD

    return action


_started_once = False  # this process's profiler has started (its first start is special)


def _first_start(loop) -> None:
    """Start and stop a profiler once on the worker's main thread, the first time, where torch
    was imported there (``loop`` given: a worker forked from the forkserver, whose main thread
    is the thread it was forked from as far as kineto knows). kineto initialises itself at the
    process's first start, and only on the thread that imported torch, where its client
    registered; from any other it prints "ERROR: External init callback must run in same thread
    as registerClient" into the cell's output instead. Where the rank's thread imported torch
    (a worker spawned afresh), ``loop`` is None and the cell's own start is the first."""
    global _started_once
    if _started_once or loop is None:
        return
    from torch.profiler import ProfilerActivity, profile

    done = threading.Event()

    def start_here() -> None:
        try:
            with profile(activities=[ProfilerActivity.CPU]):
                pass
        finally:
            done.set()

    loop.add_callback(start_here)
    done.wait(30)
    _started_once = True


@contextlib.contextmanager
def profiled(spec: dict[str, Any] | None, outbox, cell_id: str, loop=None):
    """Run the body under the profiler when ``spec`` asks for it, then send the trace.
    ``loop``: the worker's event loop, on its main thread (``_first_start``)."""
    if spec is None:
        yield
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    # kineto's own lines ("profiler_start", at every start and stop) would reach the cell's
    # output through fd 2; read when the profiler first starts in the process
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    _first_start(loop)
    folder = tempfile.mkdtemp(prefix="monarch-profile-")
    path = os.path.join(folder, "trace.json")
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():  # CUDA, and ROCm through HIP
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(spec),
        on_trace_ready=lambda _: ready.append(True),  # written after the cell, not in its loop
        record_shapes=bool(spec.get("record_shapes")),
    )
    problem, ready = None, []
    try:
        prof.start()
    except Exception as e:  # another profiler already runs in this process
        problem, prof = f"the profiler could not start: {e}", None
    hook = register_optimizer_step_post_hook(lambda *_: prof.step()) if prof else None
    try:
        yield
    finally:
        if hook is not None:
            hook.remove()
        if prof is not None:
            try:
                prof.stop()  # ready, where the cell ended inside the recorded steps
                if ready:
                    prof.export_chrome_trace(path)
            except Exception as e:
                problem = f"the profiler could not stop: {e}"
        steps = prof.step_num if prof is not None else 0
        payload, keep = _payload(path, problem)
        outbox.emit({"ev": "profile", "id": cell_id, "steps": steps, **payload})
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _payload(path: str, problem: str | None) -> tuple[dict[str, Any], bool]:
    """The event's trace or what became of it, and whether the trace file stays on the host."""
    if problem is None and not os.path.exists(path):
        problem = "no trace: the cell ended before its first recorded step"
    if problem is not None:
        return {"trace": None, "problem": problem}, False
    with open(path, "rb") as f:
        packed = gzip.compress(f.read(), compresslevel=3)
    if len(packed) > MAX_TRACE_BYTES:
        problem = (
            f"its trace is {len(packed) / 2**20:.0f} MiB gzipped, over the "
            f"{MAX_TRACE_BYTES // 2**20} MiB sent back; it is on its host at {path} "
            "(profile fewer steps: --profile active=1)"
        )
        return {"trace": None, "problem": problem}, True
    return {"trace": packed, "problem": None}, False
