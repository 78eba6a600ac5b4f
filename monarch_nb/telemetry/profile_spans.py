"""One rank's torch.profiler trace (Chrome JSON) as intervals on the controller's clock, and the
bounded ``Timeline`` the picture draws from every rank's.

Times here are microseconds after ``ref_ns`` (``reference_ns``), not Unix microseconds: at
1.8e15 µs a float64 steps by 0.25 µs, at the few seconds after ``ref_ns`` by far less.

CPU traces: compute is the top-level ops of the thread that ran the cell (the one with the
ProfilerStep#N ranges), communication the collectives on any thread (gloo runs its own threads,
which show their true duration, waiting included). GPU traces: both come from the kernels.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

from monarch_nb.telemetry.profile_model import RankTrace, Timeline

MAX_BARS = 20_000  # over all ranks: what a browser still pans through smoothly
GAP_US = 50.0  # shorter gaps are not drawn as idle, and under the bound such ops merge
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "c10d::", "mpi:", "ucc:")
# torch.distributed's collectives, as record_function names them (torch.distributed.all_reduce)
COLLECTIVES = frozenset(
    {
        *("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"),
        *("gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "batch_isend_irecv"),
    }
)
_JOINED = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}
_VARIANT = re.compile(r"(_into)?_(base|tensor|single|coalesced)$")  # all_gather_into_tensor
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_NCCL_KERNEL = re.compile(r"^[nr]ccl\w*?Kernel_?([A-Za-z]*)")  # NCCL's and RCCL's kernels
_STEP = re.compile(r"ProfilerStep#(\d+)$")
_WAITED = {"post_backward_reduce": "reduce_scatter", "wait_tensor": "wait"}
_WAIT = re.compile(
    r"\b(all_gather|reduce_scatter|all_reduce|all_to_all|post_backward_reduce|wait_tensor)\b"
    r"|c10d::wait"
    # torch.distributed.nn.functional's autograd functions, by their record_function names
    r"|^_(AllToAll|AllGather|ReduceScatter|AllReduce|Reduce|Broadcast)(?:Backward\d*)?$"
)


class Span(NamedTuple):
    start: float  # µs after ref_ns
    end: float
    name: str


@dataclass
class RankSpans:
    """What the numbers and the picture need from one rank's trace."""

    rank: int
    gpu: bool  # the intervals are GPU kernels, not CPU ops
    steps: list[tuple[int, float, float]]  # (ProfilerStep number, start, end), by start
    compute: list[Span]
    comm: list[Span]
    first: float | None  # the earliest event


def is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES) or collective(name) in COLLECTIVES


def collective(name: str) -> str:
    """The collective's plain name, as the straggler sentence says it: "gloo:all_reduce",
    "c10d::allreduce_" and "ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)" are all all_reduce."""
    if kernel := _NCCL_KERNEL.match(name):
        name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", kernel.group(1)).lower() or "nccl"
    elif not name.startswith(COLLECTIVE_PREFIXES) and (wait := _WAIT.search(name)):
        if wait.group(2):  # "_AllToAllBackward": all_to_all
            return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", wait.group(2)).lower()
        word = wait.group(1) or "wait"  # FSDP's "FSDP::all_gather (0)": all_gather
        return _WAITED.get(word, word)
    for prefix in (*COLLECTIVE_PREFIXES, "torch.distributed."):
        name = name.removeprefix(prefix)
    name = _VARIANT.sub("", name.strip("_"))
    return _JOINED.get(name, name)


def reference_ns(ranks: list[RankTrace]) -> int:
    """The earliest trace base on the controller's clock: each rank's times count from it."""
    return min((base_ns(rt) for rt in ranks if rt.trace is not None), default=0)


def base_ns(rt: RankTrace) -> int:
    return int((rt.trace or {}).get("baseTimeNanoseconds", 0)) + int(rt.offset_ns)


def read(rt: RankTrace, ref_ns: int) -> RankSpans:
    """The rank's steps and intervals, moved onto the controller's clock: torch's absolute time of
    an event is ``baseTimeNanoseconds / 1000 + ts`` µs on the rank's clock, plus its offset."""
    shift = (base_ns(rt) - ref_ns) / 1000
    raw = (rt.trace or {}).get("traceEvents", ())
    events = [e for e in raw if e.get("ph") == "X" and "ts" in e and "dur" in e]
    spans = [(e, float(e["ts"]) + shift, float(e["ts"]) + shift + float(e["dur"])) for e in events]
    cell = _cell_thread(events)
    on_cell = [(e, a, b) for e, a, b in spans if _thread(e) == cell]
    steps = [(int(m[1]), a, b) for e, a, b in on_cell if (m := _STEP.match(e.get("name", "")))]
    steps.sort(key=lambda step: step[1])
    gpu = any(e.get("cat") == "kernel" for e in events)
    if gpu:
        kernels = [Span(a, b, e["name"]) for e, a, b in spans if e.get("cat") in GPU_CATS]
        comm = [s for s in kernels if _NCCL_KERNEL.match(s.name)]
        compute = [s for s in kernels if not _NCCL_KERNEL.match(s.name)]
    else:
        comm = [Span(a, b, e["name"]) for e, a, b in spans if is_collective(e.get("name", ""))]
        # the cell's own waits for a collective, inside ops that are otherwise compute (FSDP's
        # "FSDP::all_gather (0)", a functional collective's wait_tensor): communication, cut
        # out of the ops around them
        waits = [Span(a, b, e["name"]) for e, a, b in on_cell if _WAIT.search(e.get("name", ""))]
        comm += [w for w in waits if not is_collective(w.name)]
        compute = _minus(_top_level(on_cell), union([(w.start, w.end) for w in waits]))
    if not steps and (compute or comm):  # profiled without a schedule: the cell is one step
        steps = [(0, min(s.start for s in compute + comm), max(s.end for s in compute + comm))]
    first = min((a for _, a, _ in spans), default=None)
    return RankSpans(rt.rank, gpu, steps, compute, comm, first)


def _thread(e: dict[str, Any]) -> tuple[Any, Any]:
    return (e.get("pid"), e.get("tid"))


def _cell_thread(events: list[dict[str, Any]]) -> tuple[Any, Any] | None:
    """The thread that ran the cell: the ProfilerStep ranges are its, else it ran the most ops."""
    steps = Counter(_thread(e) for e in events if _STEP.match(e.get("name", "")))
    ops = Counter(_thread(e) for e in events if e.get("cat") == "cpu_op")
    best = (steps or ops).most_common(1)
    return best[0][0] if best else None


def _top_level(events: list[tuple[dict[str, Any], float, float]]) -> list[Span]:
    """The ops no other op on the thread encloses (ProfilerStep aside): nested ones are part of
    their parent's time. A collective at the top hides what it runs; it counts as comm."""
    out: list[Span] = []
    end = float("-inf")
    for e, a, b in sorted(events, key=lambda x: (x[1], -x[2])):
        name = e.get("name", "")
        if _STEP.match(name) or e.get("cat") not in ("cpu_op", "user_annotation") or a < end:
            continue
        end = b
        if not is_collective(name):
            out.append(Span(a, b, name))
    return out


def _minus(spans: list[Span], cuts: list[tuple[float, float]]) -> list[Span]:
    """The parts of ``spans`` outside the (sorted, disjoint) ``cuts``."""
    out: list[Span] = []
    for s in spans:
        i = bisect.bisect_left(cuts, (s.start, s.start)) - 1
        at = s.start
        for a, b in cuts[max(i, 0) :]:
            if a >= s.end:
                break
            if b > at and a > at:
                out.append(Span(at, a, s.name))
            at = max(at, b)
        if at < s.end:
            out.append(Span(at, s.end, s.name))
    return out


# -- intervals ----------------------------------------------------------------------------------
def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def clip(spans: list[Span], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(s.start, a), min(s.end, b)) for s in spans if s.end > a and s.start < b]


def length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


def common(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """How long two unions overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(busy: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of [a, b] that the union ``busy`` leaves free."""
    out, at = [], a
    for s, e in busy:
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if b > at:
        out.append((at, b))
    return out


def idle(s: RankSpans, a: float, b: float) -> list[tuple[float, float]]:
    return gaps(union(clip(s.compute, a, b) + clip(s.comm, a, b)), a, b)


def counted(steps: list[tuple[int, float, float]], measured_from: int) -> set[int]:
    """The steps the numbers count: from ``measured_from`` on, or every step where none is
    that far (a cell without an optimizer step is all ProfilerStep#0)."""
    late = {n for n, _, _ in steps if n >= measured_from}
    return late or {n for n, _, _ in steps}


# -- the timeline -------------------------------------------------------------------------------
class _Bar(NamedTuple):
    rank: int
    start: float
    end: float
    kind: str
    name: str
    step: int
    ops: int  # how many ops the bar stands for (more once close ones merge)


def timeline(
    ranks: list[RankTrace],
    spans: dict[int, RankSpans],
    ref_ns: int,
    measured_from: int,
    max_bars: int = MAX_BARS,
) -> Timeline:
    """Every rank's bars, ms from the earliest event: compute, each collective, and the idle
    gaps of GAP_US or more inside steps; at most ``max_bars`` of them (``_bound``)."""
    origin = min((s.first for s in spans.values() if s.first is not None), default=0.0)
    bars: list[_Bar] = []
    steps: dict[str, list] = {k: [] for k in ("rank", "step", "start", "end", "warmup")}
    for rank, s in sorted(spans.items()):
        numbered = counted(s.steps, measured_from)
        starts = [a for _, a, _ in s.steps]
        for n, a, b in s.steps:
            row = (rank, n, (a - origin) / 1000, (b - origin) / 1000, n not in numbered)
            for key, value in zip(steps, row, strict=True):
                steps[key].append(value)
            bars += [
                _Bar(rank, x, y, "idle", "idle", n, 1) for x, y in idle(s, a, b) if y - x >= GAP_US
            ]
        # within the recorded steps: after the last one, an op that holds the optimizer's step
        # hook runs on through the profiler's own stop, which is no part of the cell's work
        lo, hi = (s.steps[0][1], s.steps[-1][2]) if s.steps else (float("-inf"), float("inf"))
        for kind, group in (("compute", s.compute), ("comm", s.comm)):
            bars += [
                _Bar(rank, a, b, kind, x.name, _step_at(s, starts, a), 1)
                for x in group
                if (a := max(x.start, lo)) < (b := min(x.end, hi))
            ]
    bars, left_out = _bound(bars, max_bars)
    bars.sort(key=lambda b: (b.rank, b.start))
    columns: dict[str, list] = {
        "rank": [b.rank for b in bars],
        "start": [(b.start - origin) / 1000 for b in bars],
        "end": [(b.end - origin) / 1000 for b in bars],
        "kind": [b.kind for b in bars],
        "name": [b.name for b in bars],
        "step": [b.step for b in bars],
        "dur": [(b.end - b.start) / 1000 for b in bars],
    }
    return Timeline(
        ranks=sorted(rt.rank for rt in ranks),
        status={rt.rank: rt.status for rt in ranks},
        hosts={rt.rank: rt.host for rt in ranks},
        origin_us=ref_ns / 1000 + origin,
        bars=columns,
        steps=steps,
        align_error_us=max((rt.error_ns for rt in ranks), default=0) / 1000,
        left_out=left_out,
    )


def _step_at(s: RankSpans, starts: list[float], t: float) -> int:
    i = bisect.bisect_right(starts, t) - 1
    return s.steps[i][0] if i >= 0 and t < s.steps[i][2] else -1


def _bound(bars: list[_Bar], max_bars: int) -> tuple[list[_Bar], str | None]:
    """At most ``max_bars``: close compute bars merge first, then the shortest go, compute
    before collectives and idle (those say why a step is slow)."""
    if len(bars) <= max_bars:
        return bars, None
    bars = _merge_close(bars)
    said = (
        f"To stay under {max_bars:,} bars, ops less than {GAP_US:g} µs apart are drawn as one bar"
    )
    if len(bars) <= max_bars:
        return bars, f"{said}; the trace files hold each op."
    ranked = sorted(bars, key=lambda b: (b.kind != "compute", b.end - b.start), reverse=True)
    kept, dropped = ranked[:max_bars], ranked[max_bars:]
    longest = max(b.end - b.start for b in dropped)
    shorter = f"{longest / 1000:.3g} ms" if longest >= 1000 else f"{longest:.3g} µs"
    ops = sum(b.ops for b in dropped if b.kind != "idle")
    gone = (
        f"{ops:,} ops of {shorter} or shorter are left out"
        if ops
        else f"idle gaps of {shorter} or shorter are not drawn"
    )
    return kept, f"{said} and {gone}; the trace files hold them all."


def _merge_close(bars: list[_Bar]) -> list[_Bar]:
    """Compute bars of a rank and step less than GAP_US apart as one, named for its longest op."""
    out = [b for b in bars if b.kind != "compute"]
    compute = sorted(
        (b for b in bars if b.kind == "compute"), key=lambda b: (b.rank, b.step, b.start)
    )
    run: list[_Bar] = []
    end = 0.0
    for b in [*compute, None]:
        if run and (
            b is None or (b.rank, b.step) != (run[0].rank, run[0].step) or b.start - end >= GAP_US
        ):
            top = max(run, key=lambda x: x.end - x.start)
            ops = sum(x.ops for x in run)
            name = top.name if ops == 1 else f"{top.name} +{ops - 1}"
            out.append(run[0]._replace(end=end, name=name, ops=ops))
            run = []
        if b is not None:
            end = max(end, b.end) if run else b.end
            run.append(b)
    return out
