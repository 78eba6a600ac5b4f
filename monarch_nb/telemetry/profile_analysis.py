"""What a profiled cell (``%%monarch --profile``) shows: the bounded timeline of every rank and
the per-rank numbers, from the Chrome traces the ranks exported. Runs in the notebook's kernel
on JSON, without torch.

CPU traces give their numbers here (profile_numbers.py); traces with GPU kernels get them from
HolisticTraceAnalysis (profile_hta.py), which reads the trace files in ``trace_dir``.
"""

from __future__ import annotations

from pathlib import Path

from monarch_nb.telemetry.profile_hta import hta_numbers
from monarch_nb.telemetry.profile_model import Analysis, RankTrace
from monarch_nb.telemetry.profile_numbers import cpu_numbers
from monarch_nb.telemetry.profile_spans import MAX_BARS, read, reference_ns, timeline


def analyze(
    ranks: list[RankTrace],
    measured_from: int,
    trace_dir: Path | None = None,
    max_bars: int = MAX_BARS,
) -> Analysis:
    """``measured_from``: the ProfilerStep numbers below it are warm-up, drawn but not counted
    (a rank without a later step counts all its steps). ``trace_dir``: where the ranks' trace
    files ``rank-<N>.json`` are, for HTA; None means no HTA."""
    ref = reference_ns(ranks)
    spans = {rt.rank: read(rt, ref) for rt in ranks if rt.trace is not None}
    picture = timeline(ranks, spans, ref, measured_from, max_bars)
    if any(s.gpu for s in spans.values()):
        numbers = hta_numbers(spans, measured_from, trace_dir)
    else:
        numbers = cpu_numbers(spans, measured_from)
    for rt in sorted(ranks, key=lambda rt: rt.rank):
        if rt.trace is None:
            numbers.notes.append(f"rank {rt.rank} left no trace ({rt.status}).")
    return Analysis(timeline=picture, numbers=numbers)
