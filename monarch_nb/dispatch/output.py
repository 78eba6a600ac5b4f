"""Controller side: show what the ranks print, tagged by rank, in the notebook or terminal.

The same line printed by several ranks within ``window`` seconds is shown once, tagged with all
of them (``[ranks 0-3] loss 0.5``); lines stay in order per rank. With ``stream=False`` output is
held until the cell ends and shown grouped by rank.

``clear_output()`` on a rank clears the cell's output, as in a kernel: what the rank printed before
it is shown first, and ranks that clear together clear once. With ``stream=False`` it clears
what that rank printed before.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import deque
from typing import Any

from monarch_nb.dispatch import merging
from monarch_nb.dispatch.targets import format_ranks

COLLAPSE_WINDOW = 0.2  # seconds a line waits for the same line from the other ranks
# ... counted from the last rank that joined it, up to this many windows (at least HOLD_MIN s)
# from the first: 64 ranks on a busy machine print the same line over more than one window
HOLD_WINDOWS = 5
HOLD_MIN = 1.0
# characters of a cell's lines the kernel holds for it, --noblock or --no-stream: 1,024 ranks
# printing 10 MB each would otherwise be 10 GB
OUTPUT_BOUND = 64 << 20
PROGRESS_REFRESH = 0.25


def _tag(ranks) -> str:
    return f"[{format_ranks(ranks)}]"


class ConsoleSink:
    """Writes to sys.stdout/sys.stderr and IPython's display; a live line for progress bars."""

    def __init__(self):
        self._progress: dict[tuple[int, str], str] = {}
        self._handle = None
        self._shown = ""
        self._last = 0.0

    def lines(self, name: str, text: str) -> None:
        stream = sys.stderr if name == "stderr" else sys.stdout
        stream.write(text)
        stream.flush()

    def display(
        self, ranks, data: dict[str, Any], metadata: dict[str, Any], display_id=None, update=False
    ) -> None:
        """A rank's rich output under its rank tag; with ``update``, in place of the output
        shown earlier with the same ``display_id`` (no new tag)."""
        if not update:
            sys.stdout.write(_tag(ranks) + "\n")
            sys.stdout.flush()
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            get_ipython = None
        if get_ipython is not None and get_ipython() is not None:
            extra = {"display_id": display_id, "update": update} if display_id else {}
            display(data, raw=True, metadata=metadata, **extra)
        else:
            prefix = f"{_tag(ranks)} " if update else ""
            sys.stdout.write(prefix + str(data.get("text/plain", "")) + "\n")

    def progress(self, rank: int, name: str, text: str | None) -> None:
        if text:
            self._progress[(rank, name)] = text
        else:
            self._progress.pop((rank, name), None)

    def clear(self, wait: bool) -> None:
        """IPython's clear_output in the notebook (the live progress line goes with it)."""
        try:
            from IPython import get_ipython
            from IPython.display import clear_output
        except ImportError:
            return
        if get_ipython() is not None:
            clear_output(wait=wait)
            self._handle, self._shown = None, ""

    def refresh(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < PROGRESS_REFRESH:
            return
        self._last = now
        text = (
            ""
            if final
            else "\n".join(f"[rank {r}] {t}" for (r, _), t in sorted(self._progress.items()))
        )
        if text == self._shown:
            return
        kernel_display = _kernel_display()
        if kernel_display is None:
            return
        bundle = {"text/plain": text}
        if self._handle is None:
            if not text:
                return
            self._handle = kernel_display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
        self._shown = text


class LiveSink:
    """Output of a ``--noblock`` cell in a Jupyter kernel: one display in the cell that started
    it, updated in place by display id (output printed after a cell has finished would be
    dropped by the frontend). The lines are kept in ``lines_out``, the last MAX_KEPT characters
    of them, how many earlier ones were given up in ``given_up``; rich outputs in ``rich``."""

    MAX_SHOWN = 500
    MAX_KEPT = OUTPUT_BOUND  # characters of lines kept for handle.output

    def __init__(self, kernel_display, title: str):
        self.title = title
        self.lines_out: list[str] = []
        self.rich: list[tuple[list[int], dict, dict]] = []
        self._progress: dict[tuple[int, str], str] = {}
        self._dirty = False
        self._last = 0.0
        self._shown_from = 0  # lines before it were cleared from the display (kept in lines_out)
        self._kept = 0  # characters in lines_out
        self.given_up = 0  # the earliest lines, past MAX_KEPT
        self._ending: str | None = None
        self._handle = kernel_display({"text/plain": title}, raw=True, display_id=True)

    def lines(self, name: str, text: str) -> None:
        self._keep(text.splitlines())
        self._dirty = True

    def _keep(self, lines: list[str]) -> None:
        """``lines`` kept; past MAX_KEPT characters the earliest go, down to three quarters of
        it (so that a flood gives lines up in a few large steps), counted in ``given_up``."""
        self.lines_out.extend(lines)
        self._kept += sum(map(len, lines))
        if self._kept <= self.MAX_KEPT:
            return
        drop, size = 0, self._kept
        while size > self.MAX_KEPT * 3 // 4 and drop < len(self.lines_out) - 1:
            size -= len(self.lines_out[drop])
            drop += 1
        del self.lines_out[:drop]
        self._kept, self.given_up = size, self.given_up + drop
        self._shown_from = max(self._shown_from - drop, 0)

    def output(self) -> list[str]:
        """The lines kept, behind one that says how many were given up, if any."""
        if not self.given_up:
            return list(self.lines_out)
        mib = self.MAX_KEPT >> 20
        note = f"... {_count(self.given_up, 'earlier line')} given up: only the last {mib} MiB kept"
        return [note, *self.lines_out]

    def display(
        self, ranks, data: dict[str, Any], metadata: dict[str, Any], display_id=None, update=False
    ) -> None:
        if update:  # shown with display_outputs(): the latest version in place of the first
            for i, (_, _, _, shown_id) in enumerate(self.rich):
                if shown_id == display_id:
                    self.rich[i] = (list(ranks), data, metadata, display_id)
            return
        self.rich.append((list(ranks), data, metadata, display_id))
        kinds = ", ".join(sorted(data))
        self._keep([f"{_tag(ranks)} <{kinds} output: handle.display_outputs() shows it>"])
        self._dirty = True

    def progress(self, rank: int, name: str, text: str | None) -> None:
        if text:
            self._progress[(rank, name)] = text
        else:
            self._progress.pop((rank, name), None)
        self._dirty = True

    def finish(self, ending: str) -> None:
        """The cell ended: the display's last line says how (a failure would otherwise show
        nowhere); not one of the lines the cell printed."""
        self._ending = ending
        self._dirty = True
        self.refresh(final=True)

    def clear(self, wait: bool) -> None:
        """The display shows only what comes after; ``handle.output`` keeps every line."""
        self._shown_from = len(self.lines_out)
        self._dirty = True

    def refresh(self, final: bool = False) -> None:
        now = time.monotonic()
        if not self._dirty or (not final and now - self._last < PROGRESS_REFRESH):
            return
        self._last, self._dirty = now, False
        shown = self.lines_out[max(self._shown_from, len(self.lines_out) - self.MAX_SHOWN) :]
        head = []
        has = f"the last {self.MAX_KEPT >> 20} MiB" if self.given_up else "all"
        if self._shown_from:
            head = [f"... clear_output() hid {_count(self._shown_from)} (handle.output has {has})"]
        hidden = len(self.lines_out) - self._shown_from - len(shown)
        if not self._shown_from:
            hidden += self.given_up
        if hidden:
            head.append(f"... {_count(hidden, 'earlier line')} (handle.output has {has})")
        live = [] if final else [f"[rank {r}] {t}" for (r, _), t in sorted(self._progress.items())]
        end = [self._ending] if self._ending else []
        self._handle.update({"text/plain": "\n".join(head + shown + live + end)}, raw=True)


def _shown(e: _Entry) -> list[str]:
    """A line entry as the lines it shows: one, or a few where ranks' numbers differ."""
    if e.texts is None:
        return [f"{_tag(e.ranks)} {e.text}\n"]
    return [f"{_tag(ranks)} {text}\n" for ranks, text in merging.merge(e.texts)]


def _size(e: _Entry) -> int:
    """An entry's characters: its line's, or its display's text and encoded images."""
    return len(e.text) + sum(len(v) for v in (e.data or {}).values() if isinstance(v, str))


def _count(n: int, what: str = "line") -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def live_sink(title: str) -> LiveSink | None:
    """A LiveSink where a Jupyter kernel will show it, else None (print as usual)."""
    kernel_display = _kernel_display()
    return LiveSink(kernel_display, title) if kernel_display is not None else None


def _kernel_display():
    """IPython's display where a Jupyter kernel will show live updates; else None."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    shell = get_ipython()
    return display if shell is not None and getattr(shell, "kernel", None) is not None else None


_CLEAR = "\0clear"  # an entry's stream name for clear_output, which ranks collapse like lines


class _Entry:
    __slots__ = (
        "data",
        "display_id",
        "first",
        "key",
        "kind",
        "metadata",
        "name",
        "ranks",
        "seq",
        "t",
        "text",
        "texts",
        "update",
    )

    def __init__(self, seq, kind, name, text, rank, t, data=None, metadata=None):
        self.seq, self.kind, self.name, self.text = seq, kind, name, text
        self.ranks = [rank]
        self.first = self.t = t  # t: when the last rank joined it
        self.data, self.metadata = data, metadata
        self.display_id, self.update = None, False  # a display shown again in place
        self.key = (name, text)
        self.texts: dict[int, str] | None = None  # by rank, where lines of one shape merge


class _Bucket:
    """Pending entries with the same text, in sequence order; flushed from the front."""

    __slots__ = ("entries", "head")

    def __init__(self):
        self.entries: list[_Entry] = []
        self.head = 0

    def first_after(self, seq: int) -> _Entry | None:
        i = bisect.bisect_right(self.entries, seq, lo=self.head, key=lambda e: e.seq)
        return self.entries[i] if i < len(self.entries) else None

    def pop_front(self) -> None:
        self.head += 1
        if self.head > 64 and self.head * 2 > len(self.entries):
            del self.entries[: self.head]
            self.head = 0

    def __len__(self) -> int:
        return len(self.entries) - self.head


class Renderer:
    """Turns rank events (stream, display, progress) into tagged output on a sink. With
    ``stream=False`` (``--no-stream``) it holds everything to show it grouped at the end, up to
    MAX_HELD characters; past that it shows what it holds and streams the rest, saying so."""

    MAX_HELD = OUTPUT_BOUND  # characters a --no-stream cell holds

    def __init__(
        self,
        ranks: list[int],
        sink=None,
        collapse: bool = True,
        stream: bool = True,
        window: float = COLLAPSE_WINDOW,
    ):
        self.ranks = list(ranks)
        self.sink = sink or ConsoleSink()
        self.collapse = collapse and len(self.ranks) > 1
        # many ranks: lines that differ only in their numbers merge too (merging.py)
        self.shapes = self.collapse and len(self.ranks) >= merging.GROUP_RANKS
        self.stream = stream
        self.window = window
        self.hold = max(window * HOLD_WINDOWS, HOLD_MIN)
        self._pending: deque[_Entry] = deque()
        self._by_key: dict[tuple[str, str], _Bucket] = {}
        self._last_seq: dict[int, int] = {}
        self._seq = 0
        self._held: dict[int, list[_Entry]] = {}  # --no-stream: by rank, of those that wrote
        self._held_size = 0  # their characters

    def feed(self, rank: int, ev: dict[str, Any]) -> None:
        kind = ev["ev"]
        now = time.monotonic()
        if kind == "progress":
            if self.stream:
                self.sink.progress(rank, ev["name"], ev["text"])
            return
        if kind == "stream":
            if self.stream:
                self.sink.progress(rank, ev["name"], None)
            for line in ev["lines"]:
                self._add(rank, _Entry(0, "line", ev["name"], line, rank, now))
        elif kind == "display":
            entry = _Entry(0, "display", "", "", rank, now, ev["data"], ev["metadata"])
            entry.display_id, entry.update = ev.get("display_id"), ev.get("update", False)
            self._add(rank, entry)
        elif kind == "clear":
            if self.stream:
                for name in ("stdout", "stderr"):
                    self.sink.progress(rank, name, None)
            self._add(rank, _Entry(0, "clear", _CLEAR, "wait" if ev["wait"] else "", rank, now))
        self.tick()

    def _add(self, rank: int, entry: _Entry) -> None:
        if not self.stream:
            if entry.kind == "clear":
                self._held_size -= sum(map(_size, self._held.pop(rank, [])))
                return
            self._held.setdefault(rank, []).append(entry)
            self._held_size += _size(entry)
            if self._held_size <= self.MAX_HELD:
                return
            self.sink.lines(
                "stderr",
                f"monarch-nb: --no-stream held {self.MAX_HELD >> 20} MiB of output: it is shown "
                "here, and the rest as it comes\n",
            )
            self._show_held()
            self.stream = True
            return
        if self.shapes and entry.kind == "line":
            entry.key, entry.texts = (entry.name, merging.shape(entry.text)), {rank: entry.text}
        key = entry.key
        if self.collapse and entry.kind != "display":
            # Every entry holding this rank is at or before its last seq, so the first later
            # entry with the same text is the one to join; joining keeps per-rank order.
            bucket = self._by_key.get(key)
            candidate = bucket.first_after(self._last_seq.get(rank, -1)) if bucket else None
            if candidate is None and bucket:
                candidate = self._move_to_end(bucket.entries[-1], rank)
            if candidate is not None:
                candidate.ranks.append(rank)
                candidate.t = entry.t
                if candidate.texts is not None:
                    candidate.texts[rank] = entry.text
                self._last_seq[rank] = candidate.seq
                return
        self._seq += 1
        entry.seq = self._seq
        self._last_seq[rank] = entry.seq
        self._pending.append(entry)
        if self.collapse and entry.kind != "display":
            self._by_key.setdefault(key, _Bucket()).entries.append(entry)

    def _move_to_end(self, entry: _Entry, rank: int) -> _Entry | None:
        """Let ``rank`` join an earlier entry by moving it after the rank's own later lines,
        which is allowed only while the entry is still the latest line of each of its ranks."""
        if rank in entry.ranks or any(self._last_seq.get(r) != entry.seq for r in entry.ranks):
            return None
        self._pending.remove(entry)
        self._seq += 1
        entry.seq = self._seq
        self._pending.append(entry)
        for r in entry.ranks:
            self._last_seq[r] = entry.seq
        return entry

    def tick(self, final: bool = False) -> None:
        """Show every pending entry whose window has passed or that all ranks have printed."""
        now = time.monotonic()
        out: list[_Entry] = []
        while self._pending:
            head = self._pending[0]
            complete = len(head.ranks) == len(self.ranks) or not self.collapse
            waited = now - head.t >= self.window or now - head.first >= self.hold
            if not (final or complete or waited):
                break
            self._pending.popleft()
            if head.kind != "display" and self.collapse:
                bucket = self._by_key[head.key]
                bucket.pop_front()
                if not len(bucket):
                    del self._by_key[head.key]
            out.append(head)
        self._emit(out)
        self.sink.refresh(final)

    def _emit(self, entries: list[_Entry]) -> None:
        run: list[str] = []
        run_name = None
        for e in entries:
            if e.kind == "line" and e.name == run_name:
                run.extend(_shown(e))
                continue
            if run:
                self.sink.lines(run_name, "".join(run))
                run = []
            run_name = None
            if e.kind == "line":
                run_name, run = e.name, _shown(e)
            elif e.kind == "clear":
                self.sink.clear(wait=e.text == "wait")
            else:
                self.sink.display(e.ranks, e.data, e.metadata, e.display_id, update=e.update)
        if run:
            self.sink.lines(run_name, "".join(run))

    def close(self) -> None:
        if self.stream:
            self.tick(final=True)
            return
        self._show_held()
        self.sink.refresh(final=True)

    def _show_held(self) -> None:
        """--no-stream: one block per group of ranks that printed exactly the same thing."""
        groups: dict[tuple, list[int]] = {}
        held, self._held, self._held_size = self._held, {}, 0
        place = {r: i for i, r in enumerate(self.ranks)} if held else {}
        for rank in sorted(held, key=lambda r: place.get(r, len(place))):  # in the ranks' order
            entries = held[rank]  # never empty: a rank's clear_output() takes its list away
            key = tuple((e.kind, e.name, e.text, id(e.data)) for e in entries)
            if all(e.kind == "line" for e in entries) and self.collapse:
                groups.setdefault(key, []).append(rank)
            else:
                groups[(rank, *key)] = [rank]
        for ranks in groups.values():
            entries = held[ranks[0]]
            for e in entries:
                e.ranks = ranks
            self._emit(entries)
