"""A profiled cell on the controller's side (``%%monarch --profile``, ``run(profile=...)``).

The schedule is checked and the profile folder made writable before anything is sent, so a
mistake in either costs nothing on the ranks. Each rank's trace comes back as a ``profile``
event ahead of its cell's end (rank/profiling.py), failed cell or not; once every rank has
ended, the clocks are measured (clocks.py), and the folder gets each rank's trace as torch wrote
it (``rank-N.json``), one trace of every rank on the controller's clock (``merged.json``, for
Perfetto or chrome://tracing) and ``meta.json``, from which ``load`` draws the same picture
again, in this kernel or a later one (``%monarch profile --last``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monarch_nb import errors
from monarch_nb.controller import clocks
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.telemetry.profile_model import Analysis, RankTrace

DEFAULT = {"wait": 0, "warmup": 1, "active": 3, "record_shapes": False}
DIR_ENV = "MONARCH_NB_PROFILE_DIR"  # where profile folders go; default ./monarch-profiles
USAGE = "--profile takes wait=N,warmup=N,active=N,shapes,dir=PATH (e.g. --profile active=5)"


@dataclass
class Profile:
    analysis: Analysis
    directory: Path
    title: str
    meta: dict[str, Any] = field(default_factory=dict)


def spec_of(profile: Any) -> dict[str, Any] | None:
    """The schedule ``profile`` asks for: None/False (no profile), True (the default), a string
    ``"wait=2,active=5,shapes,dir=PATH"`` or a dict of the same keys. ValueError, in one line,
    for anything else."""
    if profile is None or profile is False:
        return None
    spec = dict(DEFAULT, dir=os.environ.get(DIR_ENV) or "monarch-profiles")
    if profile is True or profile == "":
        return spec
    items = _items(profile) if isinstance(profile, str) else profile
    if not isinstance(items, dict):
        raise ValueError(f"{USAGE}; got {profile!r}")
    for key, value in items.items():
        if key == "dir" and isinstance(value, (str, os.PathLike)) and str(value):
            spec["dir"] = str(value)
        elif key in ("shapes", "record_shapes") and isinstance(value, bool):
            spec["record_shapes"] = value
        elif key in ("wait", "warmup", "active") and _count(value, key == "active") is not None:
            spec[key] = _count(value, key == "active")
        else:
            raise ValueError(f"{USAGE}; got '{key}={value}'")
    return spec


def _items(text: str) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not re.fullmatch(r"[a-z_]+", key) or (not eq and key != "shapes"):
            raise ValueError(f"{USAGE}; got {part!r}")
        items[key] = value if eq else True
    return items


def _count(value: Any, positive: bool) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    if isinstance(value, float) or n < int(positive):
        return None
    return n


def folder(spec: dict[str, Any], cell: int) -> Path:
    """A new folder for this cell's traces, made now: one that cannot be written is said in a
    line before the cell runs."""
    root = Path(spec["dir"]).expanduser()
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-cell{cell}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".written").write_text("")
        (path / ".written").unlink()
    except OSError as e:
        raise ValueError(
            f"cannot write the profile's traces under {root}: {e.strerror or e}; give a folder "
            f"that can be written with --profile dir=PATH (or set {DIR_ENV})"
        ) from None
    return path.resolve()


def chain(first, then):
    """Two ``prepare(req)`` hooks as one (either may be None)."""
    if first is None:
        return then

    def both(req) -> None:
        first(req)
        then(req)

    return both


class Profiled:
    """One profiled cell's request: its ranks' traces as they arrive, then the folder and the
    analysis."""

    def __init__(self, ctl, spec: dict[str, Any], cell: int, ranks: list[int]):
        self.ctl, self.spec, self.cell, self.ranks = ctl, spec, cell, ranks
        self.directory = folder(spec, cell)
        self.events: dict[int, dict[str, Any]] = {}

    def prepare(self, req) -> None:
        req.on_profile = self.on_profile

    def on_profile(self, rank: int, ev: dict[str, Any]) -> None:  # the reader's thread
        self.events[rank] = ev

    def show(self, outcomes: dict[int, dict[str, Any]]) -> None:
        """The timeline under the cell, kept as the controller's ``last_profile``. A profile
        that cannot be drawn says so in a line and leaves the cell's result alone."""
        try:
            self.ctl.last_profile = self.finish(outcomes)
            if errors.show_profile is not None:
                errors.show_profile(self.ctl.last_profile)
        except Exception as e:
            print(
                f"monarch-nb: the profile could not be drawn ({type(e).__name__}: {e}); the "
                f"traces that came back are in {self.directory}",
                file=sys.stderr,
            )

    def finish(self, outcomes: dict[int, dict[str, Any]]) -> Profile:
        """The folder written and the analysis made; ``outcomes``: each rank's end."""
        status = {r: _status(outcomes.get(r)) for r in self.ranks}
        offsets = clocks.offsets(self.ctl, [r for r in self.ranks if r in self.events])
        meta: dict[str, Any] = {
            "cluster": self.ctl.scheduler_address,
            "cell": self.cell,
            "spec": {k: v for k, v in self.spec.items() if k != "dir"},
            "ranks": {},
        }
        for rank in self.ranks:
            ev = self.events.get(rank, {})
            offset, error = offsets.get(rank, (0, 0))
            if ev.get("trace") is not None:
                (self.directory / f"rank-{rank}.json").write_bytes(gzip.decompress(ev["trace"]))
            problem = ev.get("problem")
            if not ev and status[rank] != "lost":
                problem = "no trace came back"
            meta["ranks"][str(rank)] = {
                "status": status[rank],
                "host": self.ctl._known.get(rank, {}).get("host", ""),
                "offset_ns": offset,
                "error_ns": error,
                "steps": ev.get("steps", 0),
                "problem": problem,
            }
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1))
        return load(self.directory, merge=True)


def _status(ev: dict[str, Any] | None) -> str:
    if ev is None:
        return "lost"
    status = ev.get("status", "lost")
    return {"cancelled": "interrupted"}.get(status, status)


def load(directory: Path, merge: bool = False) -> Profile:
    """The profile a folder holds, analysed (``merge``: write its ``merged.json`` too)."""
    from monarch_nb.telemetry.profile_analysis import analyze
    from monarch_nb.telemetry.profile_merge import merged

    meta = json.loads((directory / "meta.json").read_text())
    traces, notes = [], []
    for key, info in sorted(meta["ranks"].items(), key=lambda kv: int(kv[0])):
        rank, path = int(key), directory / f"rank-{key}.json"
        trace = json.loads(path.read_text()) if path.exists() else None
        status = info["status"] if trace is not None or info["status"] != "ok" else "lost"
        offset, error = info["offset_ns"], info["error_ns"]
        traces.append(RankTrace(rank, status, trace, offset, error, info["host"]))
        if info.get("problem"):
            notes.append(f"rank {rank}: {info['problem']}")
    spec = meta["spec"]
    if merge and any(t.trace is not None for t in traces):
        (directory / "merged.json").write_text(json.dumps(merged(traces)))
    analysis = analyze(traces, spec["wait"] + spec["warmup"], directory)
    analysis.numbers.notes.extend(notes)
    title = f"cell {meta['cell']} on {format_ranks([t.rank for t in traces])}: {_steps(meta)}"
    return Profile(analysis, directory, title, meta)


def _steps(meta: dict[str, Any]) -> str:
    """Which steps the picture measures, as the ranks took them."""
    spec = meta["spec"]
    taken = max((info.get("steps", 0) for info in meta["ranks"].values()), default=0)
    if taken == 0:
        return "the whole cell (it took no optimizer step)"
    first = spec["wait"] + spec["warmup"]
    last = min(first + spec["active"] - 1, taken)
    if last < first:
        return f"its {taken} optimizer steps, all warm-up (--profile warmup=0 measures them)"
    warm = f" after {spec['warmup']} warm-up" if spec["warmup"] else ""
    steps = f"steps {first}-{last}" if last > first else f"step {first}"
    return f"{steps} measured{warm}"


def last(ctl, spec_dir: str | None = None) -> Profile:
    """The newest profile of this cluster under the profile folder (any cluster's if it has
    none): this kernel's or an earlier one's."""
    root = Path(spec_dir or os.environ.get(DIR_ENV) or "monarch-profiles").expanduser()
    found = sorted(root.glob("*/meta.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        raise ValueError(f"no profile under {root.resolve()}: run a cell with %%monarch --profile")
    address = getattr(ctl, "scheduler_address", None) if ctl is not None else None
    for path in found:
        if json.loads(path.read_text()).get("cluster") == address:
            return load(path.parent)
    return load(found[0].parent)
