"""What ``%monarch stacks`` shows: the ranks' threads with identical stacks grouped (as a cell's
tracebacks are), the cell's own frame marked, and one line on the collectives: "ranks 0,2,3
wait in all_reduce #57; rank 1 is at #56, in data.py:88"."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from typing import Any

from monarch_nb.dispatch import merging
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.rank.cells import CELL_PREFIX

CELL_MARK = "<- the cell"
_ORDER = {"cell": 0, "actor": 1, "thread": 2, "worker": 3}


class StacksReport:
    """The stacks of some ranks at one moment. ``text()`` (also ``str()``) renders them;
    ``threads(rank)`` is one rank's threads as it sent them (frames ``[file, line, function,
    source, native]``, outermost first); ``silent`` maps the ranks that did not answer to why;
    ``summary`` is the line on the collectives (None when there is nothing to say);
    ``everything``: whether the notebook's display shows the worker's own threads too."""

    def __init__(
        self,
        ranks: list[int],
        hosts: Mapping[int, str],
        outcomes: Mapping[int, dict[str, Any]],
        elapsed: float,
        actor: str | None = None,
    ):
        self.ranks = list(ranks)
        self.hosts = dict(hosts)
        self.elapsed = elapsed
        self.actor = actor
        self.taken_at = time.time()
        self.everything = False
        self._stacks: dict[int, dict[str, Any]] = {}
        self.silent: dict[int, str] = {}
        for rank in self.ranks:
            ev = outcomes[rank]
            if ev.get("status") == "ok":
                self._stacks[rank] = ev["stacks"]
            elif ev.get("status") == "lost":
                self.silent[rank] = f"the worker is gone: {ev.get('why', 'connection lost')}"
            else:
                self.silent[rank] = ev.get("why", ev.get("status", "no answer"))

    def threads(self, rank: int) -> list[dict[str, Any]]:
        """One rank's threads (only the actor's, for an actor mesh's stacks)."""
        if rank not in self._stacks:
            raise KeyError(f"rank {rank} sent no stacks: {self.silent.get(rank, 'not asked')}")
        threads = self._stacks[rank]["threads"]
        if self.actor is not None:
            threads = [t for t in threads if t["kind"] == "actor" and t["actor"] == self.actor]
        return threads

    @property
    def summary(self) -> str | None:
        """Which collective each rank waits in, and where the others are; None where no rank
        waits in one and the ranks' counts agree (or there is no process group)."""
        waiting: dict[tuple[str, Any], list[int]] = {}
        others: dict[tuple[Any, str | None], list[int]] = {}
        counts = set()
        for rank, st in self._stacks.items():
            coll = self._collective(rank)
            if coll is not None:
                waiting.setdefault((coll["name"], coll["n"]), []).append(rank)
                counts.add(coll["n"])
            elif st.get("count") is not None and st["count"] >= 0:
                where = st.get("where") if st.get("running") else "no cell running"
                others.setdefault((st["count"], where), []).append(rank)
                counts.add(st["count"])
        if not waiting and len(counts) <= 1:
            return None
        parts = []
        for (name, n), ranks in sorted(waiting.items(), key=lambda kv: kv[1][0]):
            verb = "waits" if len(ranks) == 1 else "wait"
            parts.append(f"{format_ranks(ranks)} {verb} in {name} #{n}")
        for (count, where), ranks in sorted(others.items(), key=lambda kv: kv[1][0]):
            verb = "is" if len(ranks) == 1 else "are"
            place = f", in {where}" if where else ""
            parts.append(f"{format_ranks(ranks)} {verb} at #{count}{place}")
        return "; ".join(parts)

    def _collective(self, rank: int) -> dict[str, Any] | None:
        if self.actor is None:
            return self._stacks[rank].get("collective")
        return next((t["collective"] for t in self.threads(rank) if t.get("collective")), None)

    def groups(self, everything: bool = False) -> list[tuple[list[int], dict[str, Any]]]:
        """Threads with the same stack on several ranks, once each with those ranks: the cell's
        threads first, then actors', then the others (the worker's own only with
        ``everything``)."""
        seen: dict[tuple, tuple[list[int], dict[str, Any]]] = {}
        for rank in self._stacks:
            for t in self.threads(rank):
                if t["kind"] == "worker" and not everything:
                    continue
                frames = tuple(
                    (f[0], f[1], f[2], f[4]) for s in [t["frames"], *t.get("tasks", [])] for f in s
                )
                # a user's threads are told apart by their stacks, not by names like Thread-3
                name = t["name"] if t["kind"] in ("actor", "worker") else ""
                key = (t["kind"], name, frames)
                seen.setdefault(key, ([], t))[0].append(rank)
        return sorted(seen.values(), key=lambda g: (_ORDER.get(g[1]["kind"], 9), g[0][0]))

    def text(self, everything: bool | None = None) -> str:
        """The report as text; ``everything``: with the worker's own threads (Dask's event loop
        and pools, monarch-nb's output pumps), which are left out otherwise."""
        everything = self.everything if everything is None else everything
        what = f"actor {self.actor!r} on " if self.actor is not None else ""
        lines = [
            f"stacks of {what}{format_ranks(self.ranks)} "
            f"({len(self._stacks)} answered in {self.elapsed * 1000:.0f} ms)"
        ]
        if self.summary:
            lines.append(self.summary)
        lines.extend(self._silent())
        lines.extend(self._notes())
        for ranks, t in self.groups(everything):
            lines.append("")
            lines.append(f"[{format_ranks(ranks)}] {self._label(ranks, t)}")
            lines.extend(_render_frames(t))
        if not everything:
            lines.extend(self._hidden())
        return "\n".join(lines)

    def _silent(self) -> list[str]:
        """The ranks that did not answer, those on one host for one reason in one line (their
        pids as a range)."""
        by: dict[tuple[str, str], dict[int, str]] = {}
        for rank, why in self.silent.items():
            host = self.hosts.get(rank, "?")
            by.setdefault((host, merging.shape(why)), {})[rank] = why
        return [
            f"[{format_ranks(ranks)} on {host}] {why}"
            for (host, _), whys in by.items()
            for ranks, why in merging.merge(whys, apart=False)
        ]

    def _notes(self) -> list[str]:
        notes: dict[str, list[int]] = {}
        for rank, st in self._stacks.items():
            if st.get("note"):
                notes.setdefault(st["note"], []).append(rank)
            if self.actor is not None and not self.threads(rank):
                notes.setdefault(f"no actor {self.actor!r} here (stopped?)", []).append(rank)
            elif self.actor is None and not st.get("running"):
                notes.setdefault("no cell running", []).append(rank)
        return [f"[{format_ranks(ranks)}] {note}" for note, ranks in notes.items()]

    def _hidden(self) -> list[str]:
        if self.actor is not None:
            return []
        counts = [sum(t["kind"] == "worker" for t in st["threads"]) for st in self._stacks.values()]
        if not counts or not max(counts):
            return []
        n = str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}"
        return [
            "",
            f"(not shown: the worker's own {n} threads on each rank, its event loop, Dask's "
            "pools and monarch-nb's; %monarch stacks --all or report.text(everything=True) "
            "shows them)",
        ]

    def _label(self, ranks: list[int], t: dict[str, Any]) -> str:
        kind = t["kind"]
        if kind == "cell":
            label = "the cell's thread"
            since = self._stacks[ranks[0]].get("since")
            if since:
                label += f", running for {max(0.0, self.taken_at - since):.0f} s"
        elif kind == "actor":
            label = f"actor {t['actor']!r}"
        elif kind == "worker":
            label = f"the worker's thread {t['name']!r}"
        else:
            label = f"thread {t['name']!r}"
        if t.get("collective"):
            numbers = {
                c["n"] for r in ranks for c in self._thread_collectives(r, t) if c is not None
            }
            number = f" #{numbers.pop()}" if len(numbers) == 1 else ""
            label += f": waits in {t['collective']['name']}{number}"
        elif t.get("tasks"):
            n = len(t["tasks"])
            label += f": {n} task{'s' if n > 1 else ''} awaiting"
        elif kind == "actor" and not t["frames"]:
            label += ": idle, waiting for its next call"
        elif not t["frames"]:
            label += ": no Python frames"
        return label

    def _thread_collectives(self, rank: int, like: dict[str, Any]):
        for t in self.threads(rank):
            if t["kind"] == like["kind"] and t["frames"] == like["frames"]:
                yield t.get("collective")

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        silent = f", {len(self.silent)} not answering" if self.silent else ""
        return (
            f"<StacksReport of {format_ranks(self.ranks)}: "
            f"{len(self.groups())} distinct stacks{silent}>"
        )

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(self.text())

    def _repr_html_(self) -> str:
        out, summary = [], self.summary
        for line in self.text().splitlines():
            escaped = html.escape(line)
            if line.endswith(CELL_MARK) or line == summary:
                escaped = f"<b>{escaped}</b>"
            out.append(escaped)
        return "<pre style='margin:0'>" + "\n".join(out) + "</pre>"


def _render_frames(t: dict[str, Any]) -> list[str]:
    lines = _frames(t["frames"], t.get("cell"), "  ")
    for i, task in enumerate(t.get("tasks", [])):
        lines.append(f"  task {i + 1}, awaiting:")
        # the cell's coroutine (top-level await) is the cell's frame there
        cell = next((j for j, f in enumerate(task) if f[0].startswith(CELL_PREFIX)), None)
        lines.extend(_frames(task, cell, "    "))
    return lines


def _frames(frames: list[list], cell: int | None, indent: str) -> list[str]:
    lines = []
    for i, (filename, line, name, source, native) in enumerate(frames):
        if native:
            lines.append(f"{indent}[C] {name} ({filename})")
            continue
        mark = f"   {CELL_MARK}" if i == cell else ""
        lines.append(f'{indent}File "{filename}", line {line}, in {name}{mark}')
        if source:
            lines.append(f"{indent}  {source}")
    return lines
