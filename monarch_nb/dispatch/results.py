"""What comes back from the ranks: ValueMesh, and the errors that carry remote tracebacks."""

from __future__ import annotations

import html
import math
import reprlib
from collections.abc import Iterator, Mapping
from typing import Any

from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = 6
FULL_REPR = 4000  # characters of one rank's value that the notebook's table shows


class ValueMesh:
    """One value per rank, in rank order.

    ``mesh.values()``, ``mesh.items()`` and ``mesh.item(rank)`` read it; iterating yields the
    values; ``dims`` names the mesh's shape (``{"ranks": N}`` unless a caller says otherwise) so
    that ``mesh.item(hosts=0, gpus=1)`` also works. ``order`` lists the ranks in row-major order of
    ``dims`` when that is not rank order: position 0 of a reversed slice is its highest rank.
    """

    def __init__(
        self,
        values: Mapping[int, Any],
        dims: Mapping[str, int] | None = None,
        order: list[int] | None = None,
    ):
        self._values = dict(sorted(values.items()))
        self.dims = dict(dims) if dims else {"ranks": len(self._values)}
        self._order = list(order) if order is not None else list(self._values)

    @property
    def ranks(self) -> list[int]:
        return list(self._values)

    def values(self) -> list[Any]:
        return list(self._values.values())

    def items(self) -> list[tuple[int, Any]]:
        return list(self._values.items())

    def to_dict(self) -> dict[int, Any]:
        return dict(self._values)

    def item(self, rank: int | None = None, **point: int) -> Any:
        """The value of one rank: ``item(2)``, ``item(hosts=0, gpus=1)``, or ``item()`` on a
        mesh of one value."""
        if rank is None and not point:
            if len(self._values) != 1:
                raise ValueError(
                    f"item() needs a rank on a mesh of {len(self._values)} values; "
                    f"pass one of {self.ranks}"
                )
            return next(iter(self._values.values()))
        if point:
            rank = self._rank_of(point)
        if rank not in self._values:
            raise KeyError(f"rank {rank} is not in this mesh (ranks {self.ranks})")
        return self._values[rank]

    def _rank_of(self, point: Mapping[str, int]) -> int:
        unknown = set(point) - set(self.dims)
        if unknown:
            raise KeyError(f"unknown mesh dimension {sorted(unknown)}; dimensions are {self.dims}")
        missing = [f"{name}=" for name, size in self.dims.items() if size > 1 and name not in point]
        if missing:  # a dimension of size 1 can only be 0; any other would be a guess
            raise KeyError(f"item() needs {', '.join(missing)} too; dimensions are {self.dims}")
        rank, stride = 0, 1
        for name, size in reversed(self.dims.items()):
            index = point.get(name, 0)
            if not 0 <= index < size:
                raise IndexError(f"{name}={index} is out of range 0..{size - 1}")
            rank += index * stride
            stride *= size
        return self._order[rank] if math.prod(self.dims.values()) == len(self._order) else rank

    def __getitem__(self, rank: int) -> Any:
        return self.item(rank)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values.values())

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ValueMesh):
            same = self._values == other._values and self.dims == other.dims
            return same and self._order == other._order
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{r}: {_short.repr(v)}" for r, v in list(self._values.items())[:8])
        more = f", ... {len(self._values) - 8} more" if len(self._values) > 8 else ""
        return f"ValueMesh({{{body}{more}}})"

    def _repr_pretty_(self, p, cycle: bool) -> None:
        """IPython's display: every rank's value in full, laid out as a dict's (``repr()``
        stays short, for logs and error messages)."""
        if cycle:
            p.text("ValueMesh(...)")
            return
        with p.group(len("ValueMesh({"), "ValueMesh({", "})"):
            for i, (rank, value) in enumerate(self._values.items()):
                if i:
                    p.text(",")
                    p.breakable()
                with p.group(len(f"{rank}: "), f"{rank}: ", ""):  # continuation lines align
                    p.pretty(value)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td><pre style='margin:0'>{html.escape(_full(v))}</pre></td></tr>"
            for r, v in self._values.items()
        )
        return (
            f"<table><caption>ValueMesh over {len(self._values)} ranks</caption>"
            f"<tr><th>rank</th><th>value</th></tr>{rows}</table>"
        )


def _full(value: Any) -> str:
    """``repr(value)``, cut after FULL_REPR characters (saying how many there were)."""
    text = repr(value)
    return text if len(text) <= FULL_REPR else f"{text[:FULL_REPR]}… ({len(text)} characters)"


class UnserializableResult:
    """Stands in a ValueMesh for a rank whose value could not travel back; says why."""

    def __init__(self, rank: int, reason: str):
        self.rank = rank
        self.reason = reason

    def __repr__(self) -> str:
        return f"<rank {self.rank}: result could not be sent back: {self.reason}>"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a monarch-nb command or wait; the message says what became of it.
    IPython shows that one line: the frames where the interrupt landed are monarch-nb's."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


Interrupted.__name__ = Interrupted.__qualname__ = "KeyboardInterrupt"  # as kernels report it


class RemoteError(Exception):
    """An exception raised by user code on one rank, with its traceback as the rank saw it."""

    def __init__(self, rank: int, host: str, ename: str, evalue: str, traceback: list[str]):
        super().__init__(f"[rank {rank}] {ename}: {evalue}")
        self.rank = rank
        self.host = host
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback

    def render(self) -> list[str]:
        return [*self.traceback]

    def _render_traceback_(self) -> list[str]:
        return [f"[rank {self.rank} on {self.host}] {self.ename}: {self.evalue}", *self.render()]


class CellError(Exception):
    """Some ranks failed. ``errors`` maps rank to RemoteError; ``results`` holds the ranks that
    succeeded, so nothing they computed is lost. ``cause``: the rank whose failure set off the
    others' (releasing.py), named first, in the headline too."""

    max_shown = 5
    max_messages = 8  # per traceback, the ranks' own messages where they differ
    failure = None  # where the ranks keep the tracebacks (prompting.Failure), for ``debug``

    def __init__(
        self,
        errors: Mapping[int, RemoteError],
        results: ValueMesh,
        targets: list[int],
        headline: str | None = None,
        cause: int | None = None,
    ):
        self.errors = dict(sorted(errors.items()))
        self.results = results
        self.targets = targets
        self.cause = cause if cause in self.errors else None
        self.headline = headline or self._headline()
        first = next(iter(self.errors.values()), None)
        detail = f": {first.ename}: {first.evalue}" if first and self.cause is None else ""
        super().__init__(self.headline + detail)

    def _headline(self) -> str:
        if self.cause is None:
            return f"{len(self.errors)} of {len(self.targets)} ranks failed"
        err = self.errors[self.cause]
        released = [r for r, e in self.errors.items() if e.ename == "Released"]
        also = f" ({format_ranks(released)} released)" if released else ""
        others = len(self.errors) - len(released) - 1
        if others:
            also += f"; {others} other rank{'s' if others > 1 else ''} failed too"
        return f"rank {self.cause}: {err.ename}: {err.evalue}{also}"

    def debug(self, rank: int | None = None) -> None:
        """pdb on ``rank``'s traceback (default: the lowest that failed), in the notebook's
        input box: ``p``, ``up``, ``ll``... in the rank's frames; ``q`` ends it."""
        if self.failure is None:
            raise ClusterError("no rank kept a traceback of this error to debug")
        self.failure.debug(rank)

    def groups(self) -> list[tuple[list[int], RemoteError]]:
        """Distinct tracebacks, each with the ranks that share it, in rank order. Ranks that
        failed at the same lines with the same exception share one, whatever their messages
        (``ValueError(f"bad loss on rank {rank}")``)."""
        seen: dict[tuple, tuple[list[int], RemoteError]] = {}
        order = sorted(self.errors.items(), key=lambda item: item[0] != self.cause)
        for rank, err in order:
            key = (err.ename, _frames(err.traceback))
            seen.setdefault(key, ([], err))[0].append(rank)
        groups = list(seen.values())
        for ranks, _err in groups:
            ranks.sort()
        return groups

    def _render_traceback_(self) -> list[str]:
        lines = [self.headline]
        groups = self.groups()
        for ranks, err in groups[: self.max_shown]:
            lines.append("")
            messages = {r: self.errors[r].evalue for r in ranks}
            if len(set(messages.values())) == 1:
                lines.append(f"[{format_ranks(ranks)}] {err.ename}: {err.evalue}")
                lines.extend(err.render())
                continue
            lines.append(f"[{format_ranks(ranks)}] {err.ename}, each rank's message below")
            lines.extend(_frames(err.traceback))
            # ranks that share a message share its line: a host's lost ranks are one line
            alike: dict[str, list[int]] = {}
            for r, m in messages.items():
                alike.setdefault(m, []).append(r)
            shown = list(alike.items())[: self.max_messages]
            lines.extend(f"[{format_ranks(rs)}] {err.ename}: {m}" for m, rs in shown)
            if len(alike) > len(shown):
                lines.append(f"... {len(alike) - len(shown)} more messages; see .errors")
        if len(groups) > self.max_shown:
            lines.append(
                f"... {len(groups) - self.max_shown} more distinct tracebacks; see .errors"
            )
        return lines


def _frames(traceback: list[str]) -> tuple[str, ...]:
    """A rendered traceback without its closing exception line(s): where it was raised."""
    end = len(traceback)
    while end and not traceback[end - 1].startswith(" "):
        end -= 1
    return tuple(traceback[:end])


class CellSyntaxError(Exception):
    """A cell that does not parse; shown like a SyntaxError, without the magic's own frames."""

    def __init__(self, error: SyntaxError):
        super().__init__(f"{error.msg} (line {error.lineno}); nothing was sent to the ranks")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        import traceback

        lines = "".join(traceback.format_exception_only(SyntaxError, self.error)).splitlines()
        return [*lines[:-1], lines[-1] + " (nothing was sent to the ranks)"]


class CellTimeout(CellError):
    """The cell ran past its --timeout; the ranks still running were interrupted."""
