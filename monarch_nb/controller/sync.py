"""``%monarch sync PATH...``, the controller's side: walk the paths, hash the files, ask each
rank what it holds, and send only what differs (rank/sync.py writes it).

Each PATH (a file, or a folder such as a package) lands under its own name in a directory of
each rank's, on that rank's ``sys.path``; syncing a PATH again makes the rank's copy equal to
it, files deleted here included. The files travel on the controller's data path to each rank
(the one cells use), two round trips in all: the ranks' manifests, then what they lack. A file
is hashed again only when its stat changed (git's index does the same).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monarch_nb.dispatch import dispatch
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.rank import sync as rank_sync

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

SIZE_LIMIT_MB = 200  # all the paths of one sync together; MONARCH_NB_SYNC_LIMIT_MB overrides
SKIPPED_DIRS = {"__pycache__", ".git", ".hg", ".ipynb_checkpoints", ".mypy_cache", ".ruff_cache"}
SKIPPED_SUFFIXES = (".pyc", ".pyo")
# A file changed within this long of being hashed may change again without its stat showing
# it (file times tick at the kernel's coarse clock): it is hashed again next time.
RACY_NS = 50_000_000

# abs path -> (stat key, digest, when hashed): what is unchanged is not read again
_hashes: dict[str, tuple[tuple, str, int]] = {}


class SyncError(ValueError):
    """The user's mistake in a sync (a missing path, a loop, too much): one line."""


@dataclass
class SyncReport:
    """What one sync did: ``files`` and ``bytes`` sent (to each rank that lacked them),
    ``deleted`` files removed on the ranks, of ``total_files`` in the paths."""

    ranks: list[int]
    files: int
    bytes: int
    deleted: int
    total_files: int
    total_bytes: int
    updated: list[int]

    def __str__(self) -> str:
        where = format_ranks(self.ranks)
        if not self.updated:
            return (
                f"{where} already had all {_files(self.total_files)} "
                f"({_size(self.total_bytes)}); nothing sent"
            )
        if not self.files:
            return f"deleted {_files(self.deleted)} on {where}"
        gone = f", {_files(self.deleted)} deleted" if self.deleted else ""
        return f"sent {_files(self.files)} ({_size(self.bytes)}) to {where}{gone}"


def sync(ctl: Controller, paths, targets=None) -> SyncReport:
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not paths:
        raise SyncError("sync needs a path: a file or a folder (a package) to send to the ranks")
    paths = [os.fspath(p) for p in paths]
    tops, files = scan(paths)
    read: dict[str, bytes] = {}  # what hashing had to read: sent as it was hashed
    digests = {rel: _digest(path, read, rel) for rel, (path, _) in files.items()}
    held = dispatch.call(ctl, rank_sync.manifest, (ctl.id, tops), targets, asked="this sync")
    # Ranks that lack the same files get one request: the files are pickled once for them.
    groups: dict[tuple, list[int]] = {}
    for rank, theirs in held.items():
        send = tuple(rel for rel, d in digests.items() if theirs.get(rel) != d)
        delete = tuple(sorted(rel for rel in theirs if rel not in digests))
        if send or delete:
            groups.setdefault((send, delete), []).append(rank)
    sent_files = sent_bytes = deleted = 0
    for (send, delete), ranks in groups.items():
        payload = {}
        for rel in send:
            if rel not in read:
                read[rel] = _read(files[rel][0])
                digests[rel] = hashlib.blake2b(read[rel], digest_size=20).hexdigest()
            payload[rel] = (digests[rel], read[rel])
        args = (ctl.id, payload, list(delete))
        dispatch.call(ctl, rank_sync.apply, args, targets=ranks, asked="this sync")
        sent_files = max(sent_files, len(payload))
        sent_bytes = max(sent_bytes, sum(len(d) for _, d in payload.values()))
        deleted = max(deleted, len(delete))
    for given in paths:  # by the name it lands as: a later path of that name replaces it
        path = os.path.abspath(os.path.expanduser(given))
        ctl.synced[os.path.basename(os.path.normpath(path))] = path
    return SyncReport(
        ranks=held.ranks,
        files=sent_files,
        bytes=sent_bytes,
        deleted=deleted,
        total_files=len(files),
        total_bytes=sum(size for _, size in files.values()),
        updated=sorted(r for ranks in groups.values() for r in ranks),
    )


def resend(ctl: Controller, ranks: list[int]) -> None:
    """Ranks that came up after a sync (a restart, a replaced worker) get the paths synced
    before, as they are now. A failure is a notice, not an error: the ranks are up."""
    if not ctl.synced:
        return
    try:
        report = sync(ctl, list(ctl.synced.values()), targets=ranks)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        ctl._notice(
            f"{format_ranks(ranks)} did not get the synced code again ({why}); use %monarch sync"
        )
        return
    if report.updated:
        ctl._notice(f"sync: the synced code went to the new workers: {report}")


def size_limit() -> int:
    text = os.environ.get("MONARCH_NB_SYNC_LIMIT_MB", str(SIZE_LIMIT_MB))
    try:
        return int(float(text) * 1000**2)
    except ValueError:
        raise SyncError(f"MONARCH_NB_SYNC_LIMIT_MB must be a number of MB, got {text!r}") from None


def scan(paths: list[str]) -> tuple[list[str], dict[str, tuple[str, int]]]:
    """(the top-level names, {relative posix path: (absolute path, size)}) of ``paths``;
    nothing is read, so a refusal (too large, a loop) comes before any work."""
    limit = size_limit()
    tops: dict[str, str] = {}
    files: dict[str, tuple[str, int]] = {}
    for given in paths:
        path = os.path.abspath(os.path.expanduser(given))
        name = os.path.basename(os.path.normpath(path))
        try:
            st = os.stat(path)
        except OSError as e:
            raise SyncError(_unreadable(given, e)) from None
        if name in tops:
            raise SyncError(
                f"sync: {given!r} and {tops[name]!r} would both land as {name!r} on the ranks; "
                "sync one of them, or rename it"
            )
        tops[name] = given
        if stat.S_ISDIR(st.st_mode):
            _walk(path, name, given, {(st.st_dev, st.st_ino): given}, files)
        elif stat.S_ISREG(st.st_mode):
            files[name] = (path, st.st_size)
        else:
            raise SyncError(f"sync: {given!r} is neither a file nor a folder")
    total = sum(size for _, size in files.values())
    if total > limit:
        raise SyncError(
            f"sync: {', '.join(map(repr, paths))} hold {_size(total)} in {_files(len(files))}, "
            f"more than the {_size(limit)} limit; sync a smaller folder, or set "
            "MONARCH_NB_SYNC_LIMIT_MB"
        )
    return list(tops), files


def _walk(path: str, rel: str, shown: str, ancestors: dict, files: dict) -> None:
    """The files under ``path``, symbolic links followed; ``ancestors``: the folders above
    (device, inode) -> as shown, where a link back to one is a loop."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as e:
        raise SyncError(_unreadable(shown, e)) from None
    for entry in entries:
        if entry.name in SKIPPED_DIRS or entry.name.endswith(SKIPPED_SUFFIXES):
            continue
        child, child_shown = f"{rel}/{entry.name}", os.path.join(shown, entry.name)
        try:
            st = os.stat(entry.path)
        except OSError as e:
            if e.errno == errno.ENOENT and entry.is_symlink():
                continue  # a link to nothing (an editor's lock file): nothing to send
            raise SyncError(_unreadable(child_shown, e)) from None
        if stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in ancestors:
                raise SyncError(
                    f"sync: {child_shown!r} is a symlink loop (it leads back to "
                    f"{ancestors[key]!r}); remove the link, or sync a folder without it"
                )
            _walk(entry.path, child, child_shown, {**ancestors, key: child_shown}, files)
        elif stat.S_ISREG(st.st_mode):
            files[child] = (entry.path, st.st_size)


def _unreadable(shown: str, e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return f"sync: {shown!r} does not exist (paths are relative to {os.getcwd()})"
    if e.errno == errno.ELOOP:
        return f"sync: {shown!r} is a symlink loop; remove the link, or point it at a file"
    return f"sync: cannot read {shown!r}: {e.strerror}"


def _digest(path: str, read: dict[str, bytes] | None = None, rel: str = "") -> str:
    """The file's digest, from the cache while its stat is unchanged; what had to be read
    is kept in ``read`` (under ``rel``), to be sent as it was hashed."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SyncError(_unreadable(path, e)) from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _hashes.get(path)
    if known is not None and known[0] == key and st.st_mtime_ns < known[2] - RACY_NS:
        return known[1]
    hashed_at = time.time_ns()
    data = _read(path)
    if read is not None:
        read[rel] = data
    digest = hashlib.blake2b(data, digest_size=20).hexdigest()
    _hashes[path] = (key, digest, hashed_at)
    return digest


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SyncError(_unreadable(path, e)) from None


def _files(n: int) -> str:
    return "1 file" if n == 1 else f"{n} files"


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    if n < 1000**2:
        return f"{n / 1000:.1f} kB"
    return f"{n / 1000**2:.1f} MB"
