"""Checkpoints of a training loop, saved and loaded from a ``%%monarch`` cell on every rank.

``save`` and ``load`` are collectives over the default process group: every rank calls them at
once. torch.distributed.checkpoint (DCP) writes each rank's own shards of the model and the
optimizer, taken through ``get_state_dict``/``set_state_dict``, so plain modules, DDP, FSDP2
(``fully_shard``) and tensor-parallel DTensor models all work and a checkpoint saved at 4 ranks
loads at 2. On disk::

    PATH/latest                       "step-00000120": the last save that finished
    PATH/step-00000120/               one directory per step
        .metadata, __0_0.distcp, ...  DCP's files: the model's and the optimizer's state
        monarch.json                  what identifies the model: its tensors' names and shapes,
                                      the world size, the step, the time
        rank-00000.pt, ...            each rank's RNG states (and, in rank 0's, ``extra``)
    PATH/.step-00000125.partial-ID/   a save under way, or one that failed or was interrupted

A save is written under a temporary name and renamed by rank 0 once every rank has written its
part; ``latest`` is replaced (``os.replace``) only after that. A save that fails or is
interrupted leaves the previous checkpoint the latest and no directory that looks complete.
Each rank checks what it can on its own (the path, the step, the model, ``extra``) before the
first collective, and the ranks agree on the outcome in one small all_gather: a rank that
raised never leaves another waiting in DCP's collectives.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

META = "monarch.json"
LATEST = "latest"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SAFE = (bool, int, float, str, bytes, type(None))  # what torch.load(weights_only=True) takes


def save(
    path: str | os.PathLike,
    model,
    optimizer=None,
    *,
    step: int,
    extra: dict | None = None,
    keep: int | None = None,
) -> str:
    """Save ``model`` (and ``optimizer``) as ``step`` of the checkpoints in ``path``, on every
    rank at once. ``path``: a directory every rank sees (made if need be). ``extra``: values
    the same on every rank to keep with it (the epoch, a data order's seed, a scheduler's
    ``state_dict()``): numbers, strings, tensors and lists, tuples and dicts of them; rank 0's
    is kept. ``keep``: how many steps to keep, the latest and those before it (all by default).
    Each rank's RNG states are kept too. Returns the step's directory."""
    dist = _group()
    # get_state_dict gives an optimizer without state yet its state (a step with zero gradients
    # at lr 0, Adam's step count 1): taken back after, so that saving never changes training.
    untouched = optimizer is not None and getattr(optimizer, "state", None) == {}
    try:
        return _save(dist, Path(path).expanduser().absolute(), model, optimizer, step, extra, keep)
    finally:
        if untouched:
            optimizer.state.clear()


def _save(dist, root: Path, model, optimizer, step, extra, keep) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        _check_step(step)
        if keep is not None and (not _is_int(keep) or keep < 1):
            raise ValueError(f"keep must be a count of at least 1, got {keep!r}")
        _checked(extra)  # on every rank, though only rank 0's is kept: all say the same
        own = {"rng": _rng_state(), "extra": extra if rank == 0 else None}
        _writable(root)
        state = _state_dicts(model, optimizer)
        params = _shapes(state["model"])
        blob = io.BytesIO()
        _torch().save(own, blob)  # before any collective: a value torch cannot save fails here
        error = None
    except Exception as e:
        error = e
    answers = _agree((_failure(error, rank), step, uuid.uuid4().hex[:12]))
    _raise_first(answers, f"step {step} was not saved", error, root)
    _same_step(answers, "save was given")

    final = root / _dir_name(step)
    partial = root / f".{final.name}.partial-{answers[0][2]}"
    try:
        for old in root.glob(".step-*") if rank == 0 else ():
            # left by saves that failed; this save's own, which the others may be writing, stays
            if old != partial:
                shutil.rmtree(old, ignore_errors=True)
        import torch.distributed.checkpoint as dcp

        try:
            partial.mkdir(parents=True, exist_ok=True)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)))
            _write(partial / f"rank-{rank:05d}.pt", blob.getvalue())
        except (Exception, dcp.api.CheckpointException) as e:  # DCP's: raised on every rank
            error = e
        # The barrier: every rank has written its part (or says why not) before rank 0 renames.
        answers = _agree((_failure(error, rank),))
        _raise_first(answers, f"step {step} was not saved", error, root)
        if rank == 0:
            try:
                meta = dict(format=FORMAT, step=step, time=time.time(), world_size=world)
                meta.update(params=params, optimizer=optimizer is not None)
                _publish(root, partial, final, world, meta, keep)
            except Exception as e:
                error = e
        answers = _agree((_failure(error, rank),))
        _raise_first(answers, f"step {step} was not saved", error, root)
    except BaseException:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return str(final)


def load(
    path: str | os.PathLike,
    model,
    optimizer=None,
    *,
    step: int | None = None,
    extra: dict | None = None,
) -> int:
    """Load the checkpoint ``step`` of ``path`` (the latest by default) into ``model`` (and
    ``optimizer``), on every rank at once, at any world size: each rank reads the parts of the
    tensors it holds. At the world size it was saved at, each rank's RNG states are restored
    as they were at the save. ``extra``: a dict, updated with what ``save`` was given as its
    ``extra``. Returns the step."""
    dist = _group()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(path).expanduser().absolute()
    try:
        if step is None:
            step = latest(root)
            if step is None:
                raise ValueError(
                    f"no checkpoint in {root} (no {LATEST!r} marker there): save one first, "
                    "or pass step="
                )
        _check_step(step)
        where = root / _dir_name(step)
        meta = _meta(where, root)
        if optimizer is not None and not meta.get("optimizer"):
            raise ValueError(
                f"{where} holds no optimizer state (saved without one): load it without "
                "the optimizer"
            )
        state = _state_dicts(model, optimizer)
        _same_model(meta["params"], _shapes(state["model"]), where)
        same_world = meta["world_size"] == world
        own = _read(where / f"rank-{rank:05d}.pt") if same_world else None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict to update, got {type(extra).__name__}")
        saved_extra = _read(where / "rank-00000.pt")["extra"] if extra is not None else None
        error = None
    except Exception as e:
        error = e
    answers = _agree((_failure(error, rank), step))
    _raise_first(answers, f"step {step} was not loaded", error)
    _same_step(answers, "load found")  # a step= per rank, or a save between their reads

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(where)))
    except dcp.api.CheckpointException as e:  # raised on every rank alike: no need to agree
        failure = _failure(e, rank)
        raise RuntimeError(f"step {step} was not loaded (rank {failure[0]}: {failure[1]})") from e
    set_state_dict(
        model,
        [] if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    if own is not None:
        _set_rng_state(own["rng"])
    if extra is not None:
        extra.update(saved_extra or {})
    return step


def latest(path: str | os.PathLike) -> int | None:
    """The step of the last save in ``path`` that finished, or None. Reads files only: works
    in the notebook too, and on a rank outside any collective."""
    try:
        name = (Path(path).expanduser() / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    m = _STEP_DIR.match(name)
    if m is None or not (Path(path).expanduser() / name / META).is_file():
        return None
    return int(m.group(1))


def steps(path: str | os.PathLike) -> list[int]:
    """Every step saved in ``path`` whose save finished, in order."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return []
    found = [
        int(m.group(1))
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / META).is_file()
    ]
    return sorted(found)


def info(path: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """What ``save`` recorded for ``step`` (the latest by default): ``step``, ``time``,
    ``world_size``, ``params`` (each tensor's name and global shape), ``optimizer``."""
    root = Path(path).expanduser().absolute()
    chosen = latest(root) if step is None else step
    if chosen is None:
        raise ValueError(f"no checkpoint in {root} (no {LATEST!r} marker there)")
    _check_step(chosen)
    return _meta(root / _dir_name(chosen), root)


# -- checks each rank makes on its own, before any collective -------------------------------
def _group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "checkpoints are saved and loaded over the torch.distributed process group, and "
            "this process has none: call save and load in a %%monarch cell, on a cluster "
            "started without --no-dist (or after dist.init_process_group)"
        )
    return dist


def _check_step(step) -> None:
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be a whole number of at least 0, got {step!r}")


def _is_int(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


def _writable(root: Path) -> None:
    """``root`` made if need be and a file written there: a directory that does not let us
    write, a path through a regular file, a read-only file system all fail here."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = e.strerror or type(e).__name__
        where = Path(e.filename) if e.filename else root
        if where != root and root not in where.parents:  # above it; not the probe's name in it
            why += f": {where}"
        raise ValueError(
            f"checkpoints cannot be written to {root} ({why}): pick a directory every rank "
            "can write to"
        ) from None


def _checked(value, where: str = "extra") -> None:
    """A one-line ValueError naming the first value of ``extra`` a checkpoint cannot keep: it
    is read back with ``torch.load(weights_only=True)``, which runs no code."""
    torch = _torch()
    if where == "extra" and value is not None and type(value) is not dict:
        raise ValueError(f"extra must be a dict, got {type(value).__name__}")
    if type(value) is dict:
        for k, v in value.items():
            if type(k) not in _SAFE:
                raise ValueError(f"{where} has a key of type {type(k).__name__}: {_KEEPS}")
            _checked(v, f"{where}[{k!r}]")
    elif type(value) in (list, tuple):
        for i, v in enumerate(value):
            _checked(v, f"{where}[{i}]")
    elif type(value) not in (*_SAFE, torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"{where} is a {type(value).__name__}: {_KEEPS}")


_KEEPS = "a checkpoint's extra keeps numbers, strings, tensors, and lists, tuples and dicts of them"


def _state_dicts(model, optimizer) -> dict[str, dict]:
    """``{"model": ..., "optim": ...}`` as DCP takes them: names without the wrappers'
    prefixes (DDP's ``module.``), FSDP2's and tensor parallelism's shards as DTensors, the
    optimizer's state keyed by parameter name; no ``optim`` without an optimizer."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _shapes(model_sd: dict) -> dict[str, list[int] | None]:
    """Each entry's name and global shape (a DTensor's ``shape`` is the whole tensor's)."""
    return {k: list(v.shape) if hasattr(v, "shape") else None for k, v in model_sd.items()}


def _same_model(saved: dict, here: dict, where: Path) -> None:
    another = f"{where} is of another model:"
    for name, shape in here.items():
        if name not in saved:
            raise ValueError(f"{another} it has no {name!r}, which this model has")
        if saved[name] != shape:
            there, now = ("not a tensor" if s is None else tuple(s) for s in (saved[name], shape))
            raise ValueError(f"{another} {name!r} is {there} there and {now} here")
    if extra := [name for name in saved if name not in here]:
        raise ValueError(f"{another} it has {extra[0]!r}, which this model lacks")


def _meta(where: Path, root: Path) -> dict[str, Any]:
    try:
        meta = json.loads((where / META).read_text())
    except FileNotFoundError:
        if (where / ".metadata").is_file():
            raise ValueError(
                f"{where} is a torch.distributed.checkpoint without {META}: load it with "
                "dcp.load (monarch_nb.checkpoint.load reads what its save wrote)"
            ) from None
        there = ", ".join(map(str, steps(root))) or "none"
        raise ValueError(
            f"{root} has no finished checkpoint {where.name} (steps: {there})"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where / META} cannot be read ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{where / META} is not a monarch_nb checkpoint's of format {FORMAT}")
    return meta


def _read(file: Path) -> dict:
    try:
        return _torch().load(file, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{file} is missing: the checkpoint is incomplete") from None


def _failure(e: BaseException | None, rank: int) -> tuple[int, str, bool] | None:
    """(rank, one line, whether it is a mistake our checks caught) for the other ranks."""
    if e is None:
        return None
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: the ranks' own errors
    if isinstance(failures, dict) and failures:
        rank, (e, _) = min(failures.items(), key=lambda item: item[0])
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, ValueError) and _raised_here(e):
        return rank, text, True
    return rank, f"{type(e).__name__}: {text}" if text else type(e).__name__, False


def _raised_here(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == __file__


# -- the collectives and the files ---------------------------------------------------------
def _agree(mine: tuple) -> list[tuple]:
    """Every rank's ``mine``, in rank order: one small all_gather, so every rank takes the same
    turn after it."""
    import torch.distributed as dist

    answers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, mine)
    return answers


def _same_step(answers: list[tuple], said: str) -> None:
    if len({a[1] for a in answers}) > 1:
        steps = ", ".join(f"rank {r}: {a[1]}" for r, a in enumerate(answers))
        raise ValueError(
            f"{said} a different step on each rank ({steps}): give every rank the same one "
            "(the latest changed between the ranks' reads? load again)"
        )


def _raise_first(answers: list[tuple], what: str, error, root: Path | None = None) -> None:
    """The same one line on every rank when any rank failed; on the rank whose own code raised
    (a model's ``state_dict``, the disk), the exception it raised follows as the cause."""
    failures = list(dict.fromkeys(a[0] for a in answers if a[0] is not None))  # DCP's: alike
    if not failures:
        return
    rank, text, ours = failures[0]
    if ours:  # a mistake our checks caught: said as it is, once where every rank said it
        everywhere = len(failures) == len(answers) and all(f[1] == text for f in failures)
        raise ValueError(text if everywhere else f"rank {rank}: {text}") from None
    who = ", ".join(f"rank {f[0]}: {f[1]}" for f in failures)
    end = ")"
    if root is not None:  # a save: what a load finds instead
        last = latest(root)
        end += f"; the latest is still step {last}" if last is not None else "; no latest yet"
    raise RuntimeError(f"{what} ({who}{end}") from error


def _publish(root: Path, partial: Path, final: Path, world: int, meta: dict, keep) -> None:
    """On rank 0, after every rank wrote its part: the metadata in, the directory renamed to
    its step's name, then ``latest`` replaced; older steps beyond ``keep`` removed last."""
    written = len(list(partial.glob("rank-*.pt")))
    if written != world:
        raise ValueError(
            f"only {written} of the {world} ranks' files are in {partial} as rank 0 sees it: "
            f"{root} is not one directory shared by every rank (put checkpoints on a file "
            "system they all mount)"
        )
    _write(partial / META, json.dumps(meta, indent=1).encode())
    if final.exists():  # saved again (a run gone on from an earlier step): the new one wins
        old = root / f".{final.name}.replaced-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    marker = root / f".{LATEST}.{uuid.uuid4().hex[:12]}"
    _write(marker, final.name.encode() + b"\n")
    os.replace(marker, root / LATEST)
    _sync_dir(root)
    if keep is not None:
        older = [s for s in steps(root) if s < meta["step"]]
        for s in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(root / _dir_name(s), ignore_errors=True)


def _write(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(root: Path) -> None:
    """The renames made durable: a crash after ``save`` returned keeps them."""
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _torch():
    import torch

    return torch


# -- RNG states: what the losses after a resume depend on besides the model and optimizer ---
def _rng_state() -> dict[str, Any]:
    """This rank's generators: torch's (and CUDA's where this process started CUDA), Python's
    ``random`` and numpy's global one where numpy is imported."""
    torch = _torch()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch = _torch()
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
