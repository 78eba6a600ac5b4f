"""Moving data between the notebook and the ranks: ``push``, ``pull``, ``scatter``, ``gather``,
and functions sent by value, ``apply`` and ``map``. Each is a call in the ranks' threads, queued
behind the cells sent before it; what the user hands over is pickled here, so that a value
that cannot travel is refused, in one line, before anything is sent. The ``Controller``
methods of the same names document them."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cloudpickle

from monarch_nb.dispatch import dispatch
from monarch_nb.dispatch.names import python_name, rank_name
from monarch_nb.dispatch.results import CellError, UnserializableResult, ValueMesh
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.rank import remote

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller


def push(ctl: Controller, values: Mapping[str, Any], targets=None) -> None:
    payload = {}
    for raw, value in values.items():
        name = rank_name(raw, "cannot push to")
        try:
            payload[name] = cloudpickle.dumps(value, protocol=5)
        except Exception as e:
            raise ValueError(
                f"cannot push {name!r}: {type(value).__name__} cannot be pickled ({e})"
            ) from None
    dispatch.call(ctl, remote.push, (payload,), targets, asked="this push")


def pull(
    ctl: Controller, names: str | list[str], targets=None, asked: str = "this pull"
) -> ValueMesh:
    many = not isinstance(names, str)
    keys = [python_name(n, "cannot pull") for n in (names if many else [names])]
    try:
        mesh = dispatch.call(ctl, remote.pull, (keys,), targets, asked=asked)
    except CellError as e:
        missing = [r for r, err in e.errors.items() if err.ename == "NameError"]
        if missing and len(missing) == len(e.errors):
            what = ", ".join(sorted({err.evalue.split("'")[1] for err in e.errors.values()}))
            raise NameError(f"{what} is not defined on {format_ranks(missing)}") from None
        raise
    rows: dict[int, list[Any]] = {}
    failed: dict[tuple[str, str], list[int]] = {}  # (name, why) -> ranks
    for rank, blobs in mesh.items():
        rows[rank] = []
        for name, blob in zip(keys, blobs, strict=True):
            if isinstance(blob, str):  # why it could not be pickled on the rank
                failed.setdefault((name, blob), []).append(rank)
                continue
            try:
                rows[rank].append(cloudpickle.loads(blob))
            except Exception as e:
                why = f"it cannot be unpickled here ({type(e).__name__}: {e})"
                failed.setdefault((name, why), []).append(rank)
    if failed:
        (name, why), ranks = next(iter(failed.items()))
        raise ValueError(f"cannot pull {name!r} from {format_ranks(ranks)}: {why}")
    return ValueMesh({r: tuple(row) if many else row[0] for r, row in rows.items()})


def scatter(ctl: Controller, name: str, sequence, targets=None) -> None:
    name = rank_name(name, "cannot scatter to")
    ranks = ctl.targets(targets)
    try:
        n = len(sequence)
        sequence[0:0]
    except TypeError:
        raise TypeError(
            f"scatter needs a sequence with len() and slicing, got {type(sequence).__name__}"
        ) from None
    chunks = {}
    for rank, (start, stop) in zip(ranks, chunk_bounds(n, len(ranks)), strict=True):
        chunk = sequence[start:stop]
        if type(chunk).__module__.split(".")[0] == "torch":
            chunk = chunk.clone()  # a slice is a view, and a view pickles its whole storage
        try:
            chunks[rank] = ({name: cloudpickle.dumps(chunk)},)
        except Exception as e:
            raise ValueError(
                f"cannot scatter {name!r}: its chunks cannot be pickled ({e})"
            ) from None
    dispatch.call(ctl, remote.push, targets=ranks, per_rank=chunks, asked="this scatter")


def gather(ctl: Controller, name: str, targets=None):
    values = pull(ctl, name, targets, asked="this gather").values()
    try:
        return remote.concat(values)
    except Exception as e:
        kinds = ", ".join(sorted({type(v).__name__ for v in values}))
        why = (str(e) or type(e).__name__).splitlines()[0]
        raise ValueError(
            f"cannot gather {name!r}: the ranks' values ({kinds}) do not join: {why}"
        ) from None


def apply(ctl: Controller, fn, args: tuple, kwargs: dict, targets=None) -> ValueMesh:
    if not callable(fn):
        raise TypeError(f"apply takes a function to run on the ranks, got {type(fn).__name__}")
    try:
        blob = cloudpickle.dumps((fn, args, kwargs), protocol=5)
    except Exception as e:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(
            f"apply: {name} or its arguments cannot be sent to the ranks: {e}"
        ) from None
    return dispatch.call(ctl, _apply, (blob,), targets, asked="this apply")


def map_chunks(ctl: Controller, fn, sequences: tuple, targets=None) -> list:
    if not callable(fn):
        raise TypeError(f"map takes a function to run on the ranks, got {type(fn).__name__}")
    if not sequences:
        raise TypeError("map needs at least one sequence of items for the function")
    try:
        columns = [list(seq) for seq in sequences]
    except TypeError as e:
        raise TypeError(f"map needs sequences (or other iterables): {e}") from None
    if len({len(c) for c in columns}) > 1:
        lengths = ", ".join(str(len(c)) for c in columns)
        raise ValueError(f"map: the sequences have different lengths ({lengths})")
    items = list(zip(*columns, strict=True))
    ranks = ctl.targets(targets)
    chunks = {}
    for rank, (start, stop) in zip(ranks, chunk_bounds(len(items), len(ranks)), strict=True):
        if start == stop:
            continue
        try:
            chunks[rank] = (cloudpickle.dumps((fn, items[start:stop]), protocol=5),)
        except Exception as e:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise TypeError(f"map: {name} or its items cannot be sent to the ranks: {e}") from None
    if not chunks:
        return []
    mesh = dispatch.call(ctl, _map, targets=list(chunks), per_rank=chunks, asked="this map")
    for rank, part in mesh.items():
        if isinstance(part, UnserializableResult):
            raise ValueError(f"map: rank {rank}'s results cannot come back: {part.reason}")
    return [result for part in mesh.values() for result in part]


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, stop) ranges over ``n`` items, sizes differing by at most 1,
    the larger first (as ipyparallel's scatter and numpy's array_split)."""
    size, extra = divmod(n, parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _apply(engine, blob: bytes):
    fn, args, kwargs = cloudpickle.loads(blob)
    return fn(*args, **kwargs)


def _map(engine, blob: bytes) -> list:
    fn, items = cloudpickle.loads(blob)
    return [fn(*item) for item in items]
