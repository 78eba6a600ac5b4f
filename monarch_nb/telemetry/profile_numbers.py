"""Per rank time in compute, communication and idle over the measured steps of a CPU trace, and
the sentence that names the straggler.

``comm_ms`` is the communication compute did not hide (the exposed part), so that compute, comm
and idle add up to the step, as HolisticTraceAnalysis's breakdown does for GPUs; ``overlap`` is
the share of all communication that compute hid.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from monarch_nb.telemetry.profile_model import Numbers
from monarch_nb.telemetry.profile_spans import (
    RankSpans,
    clip,
    collective,
    common,
    counted,
    length,
    union,
)

CPU_SOURCE = "CPU ops and collectives"
SLOWER = 0.25  # the straggler's busy time exceeds the others' median by at least this share: ranks
# that share cores (4 CPU ranks on 2) differ by 15-23% with nothing wrong; a real straggler more


def windows(s: RankSpans, measured_from: int) -> list[tuple[float, float]]:
    """The measured steps' (start, end)."""
    numbered = counted(s.steps, measured_from)
    return [(a, b) for n, a, b in s.steps if n in numbered]


def waits(s: RankSpans, measured_from: int) -> Counter[str]:
    """Per collective, how long compute did not hide it in the measured steps (µs): where the
    rank waits for the others."""
    out: Counter[str] = Counter()
    by_name: dict[str, list] = {}
    for span in s.comm:
        by_name.setdefault(collective(span.name), []).append(span)
    for a, b in windows(s, measured_from):
        busy = union(clip(s.compute, a, b))
        for name, group in by_name.items():
            comm = union(clip(group, a, b))
            out[name] += length(comm) - common(comm, busy)
    return out


def rank_row(s: RankSpans, measured_from: int) -> dict[str, Any] | None:
    """The rank's row of ``Numbers.rows``, per measured step; None without steps."""
    steps = windows(s, measured_from)
    if not steps:
        return None
    step = compute = comm = hidden = idle = 0.0
    for a, b in steps:
        busy = union(clip(s.compute, a, b))
        talk = union(clip(s.comm, a, b))
        both = common(busy, talk)
        step += b - a
        compute += length(busy)
        comm += length(talk)
        hidden += both
        idle += (b - a) - (length(busy) + length(talk) - both)
    n = len(steps)
    return {
        "rank": s.rank,
        "steps": n,
        "step_ms": step / n / 1000,
        "compute_ms": compute / n / 1000,
        "comm_ms": (comm - hidden) / n / 1000,
        "idle_ms": idle / n / 1000,
        "overlap": hidden / comm if comm > 0 else 0.0,
    }


def straggler(
    rows: list[dict[str, Any]], waited: dict[int, Counter[str]]
) -> tuple[str | None, int | None]:
    """The rank busiest per step (compute and idle: the step less the communication it waited
    in) if it is SLOWER beyond the others' median, and where the others wait for it."""
    busy = {row["rank"]: row["compute_ms"] + row["idle_ms"] for row in rows}
    if len(busy) < 2:
        return None, None
    top = max(busy, key=lambda r: busy[r])
    median = statistics.median(v for r, v in busy.items() if r != top)
    if median <= 0 or busy[top] < median * (1 + SLOWER):
        return None, None
    sentence = f"rank {top} is {round(100 * (busy[top] / median - 1))}% slower per step"
    others = sum((w for r, w in waited.items() if r != top), Counter())
    if others:
        sentence += f"; the others wait for it in {others.most_common(1)[0][0]}"
    return sentence, top


def cpu_numbers(spans: dict[int, RankSpans], measured_from: int) -> Numbers:
    rows = [row for _, s in sorted(spans.items()) if (row := rank_row(s, measured_from))]
    waited = {r: waits(s, measured_from) for r, s in spans.items()}
    sentence, rank = straggler(rows, waited)
    return Numbers(source=CPU_SOURCE, rows=rows, straggler=sentence, straggler_rank=rank)
