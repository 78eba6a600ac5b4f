"""One Chrome trace of every rank of a profiled cell on the controller's clock, for Perfetto or
chrome://tracing: a process per rank (pid = rank, named "rank N"), its threads and GPU streams
inside it, torch's metadata kept.

Each rank's events are moved by the difference of its base (``baseTimeNanoseconds`` plus its
clock offset) from the merged trace's, the earliest of them, so ``base / 1000 + ts`` is the
controller's time of every event.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from monarch_nb.telemetry.profile_model import RankTrace
from monarch_nb.telemetry.profile_spans import base_ns, reference_ns

_REPLACED = ("process_name", "process_sort_index")  # the rank's own stand in for torch's
_LABELS = "process_labels"  # torch's name for a GPU's process: "GPU 0"
_LANES = 2**31  # thread ids past Linux's (below 2**22); Perfetto takes 32-bit ones only


def merged(ranks: list[RankTrace]) -> dict[str, Any]:
    present = sorted((rt for rt in ranks if rt.trace is not None), key=lambda rt: rt.rank)
    base = reference_ns(ranks)
    events: list[dict[str, Any]] = []
    for i, rt in enumerate(present):
        events += [
            _meta(rt.rank, "process_name", {"name": f"rank {rt.rank}"}),
            _meta(rt.rank, "process_sort_index", {"sort_index": rt.rank}),
        ]
        events += _moved(rt, (base_ns(rt) - base) / 1000, i, len(present))
    return {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "traceName": f"monarch: {len(present)} ranks",
        "traceEvents": events,
    }


def _meta(pid: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": 0, "args": args}


def _moved(rt: RankTrace, shift: float, index: int, count: int) -> list[dict[str, Any]]:
    """The rank's events in its process: the CPU process keeps its thread ids; another's (a GPU,
    torch's "Spans") threads get ids past any OS thread's, named for it: "GPU 0 stream 7"."""
    raw = (rt.trace or {}).get("traceEvents", [])
    ops = Counter(e.get("pid") for e in raw if e.get("cat") in ("cpu_op", "user_annotation"))
    main = ops.most_common(1)[0][0] if ops else None
    labels = {
        e.get("pid"): e.get("args", {}).get("labels") for e in raw if e.get("name") == _LABELS
    }
    named = {_thread(e) for e in raw if e.get("name") == "thread_name"}
    lanes: dict[tuple[Any, Any], int] = {}
    out = []
    for e in raw:
        if e.get("ph") == "M" and e.get("name") in _REPLACED:
            continue
        e = dict(e)
        pid, e["pid"] = e.get("pid"), rt.rank
        if "ts" in e:
            e["ts"] = e["ts"] + shift
        if pid != main:
            where = labels.get(pid) or pid
            if (key := (pid, e.get("tid"))) not in lanes:
                lanes[key] = _LANES + len(lanes)
                if key not in named:
                    out.append(
                        _meta(
                            rt.rank, "thread_name", {"name": f"{where} {key[1]}".strip() or "trace"}
                        )
                    )
                    out[-1]["tid"] = lanes[key]
            e["tid"] = lanes[key]
            if e.get("name") == "thread_name" and "args" in e:
                e["args"] = {**e["args"], "name": f"{where} {e['args'].get('name')}"}
        if e.get("ph") in ("s", "t", "f") and "id" in e:  # flows must not join across ranks
            e["id"] = (
                e["id"] * count + index if isinstance(e["id"], int) else f"{rt.rank}:{e['id']}"
            )
        out.append(e)
    return out


def _thread(e: dict[str, Any]) -> tuple[Any, Any]:
    return (e.get("pid"), e.get("tid"))
