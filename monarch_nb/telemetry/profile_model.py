"""What a profiled cell (``%%monarch --profile``) leaves: each rank's trace with its clock's
offset, and what the notebook draws and prints from them. Plain data; the reading of traces is
profile_spans.py, the numbers profile_numbers.py, the picture timeline_figure.py.

Times in a ``Timeline`` are milliseconds from ``origin_us``, a point on the controller's clock
(Unix time in microseconds, as torch's exported traces count, ``baseTimeNanoseconds / 1000 +
ts``): each rank's events are moved onto the controller's clock by its ``offset_ns`` first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("compute", "comm", "idle")


@dataclass
class RankTrace:
    """One rank's part of a profiled cell."""

    rank: int
    status: str  # how its cell ended: "ok", "error", "interrupted", "lost" (then no trace)
    trace: dict[str, Any] | None  # the Chrome trace torch.profiler exported, as JSON
    offset_ns: int = 0  # added to the rank's clock, it reads the controller's
    error_ns: int = 0  # the offset is right within this (half the best round trip)
    host: str = ""


@dataclass
class Timeline:
    """The bars the picture draws, bounded (MAX_BARS in profile_spans.py)."""

    ranks: list[int]  # every rank the cell was profiled on, in order
    status: dict[int, str]  # rank -> RankTrace.status
    hosts: dict[int, str]
    origin_us: float  # x = 0, on the controller's clock
    # columns of equal length: rank (int), start and end (ms from origin), kind (one of KINDS),
    # name (the op or collective: "aten::mm", "gloo:all_reduce"; "idle"), step (int, -1 if
    # outside every ProfilerStep), dur (ms)
    bars: dict[str, list]
    # columns: rank, step, start, end (ms), warmup (True for the warm-up steps, drawn but not
    # counted in the numbers)
    steps: dict[str, list]
    align_error_us: float  # the largest of the ranks' offset bounds
    left_out: str | None = None  # what the bound left out of ``bars``, one sentence


@dataclass
class Numbers:
    """Per rank time in compute, communication and idle over the measured steps."""

    source: str  # "CPU ops and collectives" or "HolisticTraceAnalysis (GPU kernels)"
    # one dict per rank with a trace: rank, steps (how many measured), step_ms (mean per
    # measured step), compute_ms, comm_ms, idle_ms (per step), overlap (share of the
    # communication time that compute overlapped, 0..1)
    rows: list[dict[str, Any]]
    # "rank 3 is 41% slower per step; the others wait for it in all_reduce"
    straggler: str | None = None
    straggler_rank: int | None = None
    notes: list[str] = field(default_factory=list)  # e.g. how to get HTA's numbers


@dataclass
class Analysis:
    timeline: Timeline
    numbers: Numbers
