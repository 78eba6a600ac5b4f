"""``%monarch sync``, a rank's side: the directory of one controller's synced code, first on
``sys.path``, and what it holds.

The directory lives in the worker's own scratch directory (local to the rank's host, made
afresh for each worker process), one per controller; it goes when the controller's link
does (``forget``). A rank keeps the digest of each file it was sent, so the controller can
ask what differs without anything being read again.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import shutil
import sys
import threading

_lock = threading.Lock()
_manifests: dict[str, dict[str, str]] = {}  # directory -> {relative path: digest}


def directory(engine, controller: str) -> str:
    return os.path.join(engine.worker.local_directory, f"monarch-sync-{controller[:12]}")


def manifest(engine, controller: str, tops: list[str]) -> dict[str, str]:
    """The digests this rank holds of the files under ``tops`` (top-level names)."""
    with _lock:
        held = _manifests.get(directory(engine, controller), {})
        return {rel: d for rel, d in held.items() if rel.split("/", 1)[0] in tops}


def apply(
    engine, controller: str, files: dict[str, tuple[str, bytes]], delete: list[str]
) -> tuple[int, int]:
    """Write ``files`` ({relative path: (digest, contents)}), remove ``delete``; the
    directory goes first on ``sys.path``. Returns (files written, bytes)."""
    root = directory(engine, controller)
    with _lock:
        held = _manifests.setdefault(root, {})
        for rel in delete:
            target = _inside(root, rel)
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
            _drop_bytecode(target)
            held.pop(rel, None)
            _prune(root, os.path.dirname(target))
        for rel, (digest, data) in files.items():
            target = _inside(root, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            partial = f"{target}.monarch-partial"
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, target)  # an import meanwhile sees the old file or the new
            _drop_bytecode(target)
            held[rel] = digest
    if root not in sys.path:
        sys.path.insert(0, root)
    importlib.invalidate_caches()  # new files and folders are found by the next import
    return len(files), sum(len(data) for _, data in files.values())


def forget(engine, controller: str) -> None:
    """The controller went away: its directory, and its place on ``sys.path``, go too."""
    root = directory(engine, controller)
    with _lock:
        _manifests.pop(root, None)
    with contextlib.suppress(ValueError):
        sys.path.remove(root)
    shutil.rmtree(root, ignore_errors=True)


def _inside(root: str, rel: str) -> str:
    target = os.path.normpath(os.path.join(root, rel))
    if os.path.isabs(rel) or not target.startswith(root + os.sep):
        raise ValueError(f"sync: {rel!r} is not a path inside the synced directory")
    return target


def _drop_bytecode(target: str) -> None:
    """A rewritten source of the same size within the same second would pass the cached
    bytecode's check (it keeps whole seconds): the old code would run."""
    if not target.endswith(".py"):
        return
    folder, name = os.path.split(target)
    stem = name[: -len(".py")]
    for pyc in glob.glob(
        os.path.join(glob.escape(folder), "__pycache__", f"{glob.escape(stem)}.*.pyc")
    ):
        with contextlib.suppress(FileNotFoundError):
            os.remove(pyc)


def _prune(root: str, folder: str) -> None:
    """Folders that deleting files emptied (their bytecode caches aside) go too."""
    while folder.startswith(root + os.sep):
        with contextlib.suppress(FileNotFoundError):
            if set(os.listdir(folder)) <= {"__pycache__"}:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                return
        folder = os.path.dirname(folder)
