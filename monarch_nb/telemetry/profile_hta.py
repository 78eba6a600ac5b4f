"""The per-rank numbers of GPU traces, from HolisticTraceAnalysis (HTA) reading the trace files
the ranks wrote (``trace_dir/rank-<N>.json``): its temporal breakdown, its communication and
computation overlap, and its straggler test beside ours.

HTA is imported when first needed: it brings pandas and plotly, which a notebook without GPU
traces never needs. Its breakdown counts memory copies with communication (as "non-compute").
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from monarch_nb.telemetry.profile_model import Numbers
from monarch_nb.telemetry.profile_numbers import straggler, waits, windows
from monarch_nb.telemetry.profile_spans import RankSpans, counted

HTA_SOURCE = "HolisticTraceAnalysis (GPU kernels)"
INSTALL = "pip install HolisticTraceAnalysis"


def hta_numbers(spans: dict[int, RankSpans], measured_from: int, trace_dir: Path | None) -> Numbers:
    """Rows empty and a note saying why where HTA is missing, has no files to read, or fails:
    the timeline does not need it."""
    try:
        from hta import trace_analysis
    except ImportError:
        return _without(
            f"The per-rank numbers of GPU traces come from HolisticTraceAnalysis: {INSTALL}"
        )
    files = {
        r: f"rank-{r}.json"
        for r in sorted(spans)
        if trace_dir is not None and (Path(trace_dir) / f"rank-{r}.json").is_file()
    }
    if not files:
        return _without(
            "HolisticTraceAnalysis reads the trace files (rank-<N>.json); none were written."
        )
    try:
        with _quiet():
            return _numbers(trace_analysis.TraceAnalysis, spans, measured_from, trace_dir, files)
    except Exception as e:  # HTA's own failure on an odd trace: the picture still stands
        return _without(f"HolisticTraceAnalysis failed on these traces: {type(e).__name__}: {e}")


def _without(note: str) -> Numbers:
    return Numbers(source=HTA_SOURCE, rows=[], notes=[note])


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """HTA logs every file it parses at warning level, into the notebook's output."""
    log = logging.getLogger("hta")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _numbers(
    analysis: Any,
    spans: dict[int, RankSpans],
    measured_from: int,
    trace_dir: Path | None,
    files: dict[int, str],
) -> Numbers:
    ta = analysis(trace_files=files, trace_dir=str(trace_dir), include_last_profiler_step=True)
    measured = {r: sorted(counted(spans[r].steps, measured_from)) for r in files}
    notes = []
    # HTA's breakdown spans every kernel it holds: keep the measured steps' only
    for r, df in list(ta.t.traces.items()):
        df = df[df["iteration"].isin(measured[r])]
        if df["stream"].ne(-1).any():
            ta.t.traces[r] = df
        else:
            del ta.t.traces[r]
            notes.append(f"rank {r} ran no GPU kernel in its measured steps.")
    if not ta.t.traces:
        return Numbers(source=HTA_SOURCE, rows=[], notes=notes)
    breakdown = ta.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = ta.get_comm_comp_overlap(visualize=False).set_index("rank")
    rows = []
    for r in sorted(ta.t.traces):
        n = len(measured[r])
        row = breakdown.loc[r]
        share = float(overlap.loc[r, "comp_comm_overlap_pctg"]) / 100
        rows.append(
            {
                "rank": r,
                "steps": n,
                "step_ms": sum(b - a for a, b in windows(spans[r], measured_from)) / n / 1000,
                "compute_ms": float(row["compute_time(us)"]) / n / 1000,
                "comm_ms": float(row["non_compute_time(us)"]) / n / 1000,
                "idle_ms": float(row["idle_time(us)"]) / n / 1000,
                "overlap": 0.0 if math.isnan(share) else share,
            }
        )
    sentence, rank = straggler(rows, {r: waits(spans[r], measured_from) for r in ta.t.traces})
    late = _late_starter(ta, sorted({n for steps in measured.values() for n in steps}))
    if late is not None and rank is not None and late != rank:
        notes.append(
            f"HolisticTraceAnalysis's test (whose collectives start last) says rank {late}."
        )
    return Numbers(HTA_SOURCE, rows, straggler=sentence, straggler_rank=rank, notes=notes)


def _late_starter(ta: Any, steps: list[int]) -> int | None:
    """HTA's straggler, the rank whose big collective kernels start last; it knows only NCCL's
    older "ncclKernel" names, so newer "ncclDevKernel" ones leave it nothing (then None)."""
    try:
        found = ta.get_potential_stragglers(profiler_steps=steps, num_candidates=1)
    except Exception:
        return None
    return int(found[0]) if found else None
