"""Tables of ranks that fit one screen at 64 ranks (``%monarch status``, ``up``'s table): from
GROUP_FROM ranks, the rows that are alike but for their rank become one row with the ranks as a
set, so 8 hosts of 8 GPUs read as 8 rows::

    ranks  host    device                          state          names
    0-7    node-a  cuda: NVIDIA H100 (79.1 GiB)    busy 12-13 s   4
    8-15   node-b  cuda: NVIDIA H100 (79.1 GiB)    busy 12-13 s   4
    9      node-b  cuda: NVIDIA H100 (79.1 GiB)    not answering  -

A rank's pid and its mesh coordinates differ from rank to rank, so they are left out (``%monarch
status --ranks`` and ``%monarch mesh`` show them); how long a cell has run is shown as a range.
"""

from __future__ import annotations

import re
from typing import Any

from monarch_nb.dispatch.targets import compact

GROUP_FROM = 16  # ranks from which rows are grouped (the live panel turns compact there too)
PER_RANK = ("rank", "pid", "mesh")  # columns that differ from rank to rank
_SECONDS = re.compile(r"^(\w+) (\d+(?:\.\d+)?) s$")  # "busy 12.3 s"


def group(rows: list[dict[str, Any]], columns: list[str]) -> tuple[list[dict], list[str]]:
    """``rows`` (one per rank, with ``columns``) as rows of ranks alike, and their columns:
    ``ranks`` first, then the columns that do not differ from rank to rank."""
    kept = [c for c in columns if c not in PER_RANK]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        state = _SECONDS.match(str(row.get("state", "")))
        key = tuple(state.group(1) if c == "state" and state else str(row.get(c, "")) for c in kept)
        groups.setdefault(key, []).append(row)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: kv[1][0]["rank"]):
        merged: dict[str, Any] = {"ranks": compact(sorted(r["rank"] for r in members))}
        merged.update(zip(kept, key, strict=True))
        if "state" in kept:
            merged["state"] = _state(members, merged["state"])
        out.append(merged)
    return out, ["ranks", *kept]


def _state(members: list[dict[str, Any]], state: str) -> str:
    """``busy 12.3 s`` for one rank, ``busy 12-13 s`` for several."""
    seconds = [float(m.group(2)) for r in members if (m := _SECONDS.match(str(r["state"])))]
    if not seconds:
        return state
    low, high = min(seconds), max(seconds)
    if len(members) == 1 or round(low) == round(high):
        return f"{state} {low:.1f} s" if len(members) == 1 else f"{state} {low:.0f} s"
    return f"{state} {low:.0f}-{high:.0f} s"
