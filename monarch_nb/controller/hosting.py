"""Starting a kept cluster (``%monarch up --keep``): its host process (host/), the idle limit
and the name, checked before anything starts; the name claimed (kept.claim_name) before the
host starts, and handed to it, so that of two kernels asking for one name at once one wins.

The host is started in a session of its own, with the kernel's environment, working directory
and ``sys.path`` (its workers see what a local ``up``'s would), its output in its log beside the
kept-cluster file (kept.py), its plan and token on its stdin. It says on a pipe when the
cluster is up, or why not; the kernel imports what the controller needs meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import subprocess
import sys
import threading
import uuid
from dataclasses import asdict
from typing import Any

from monarch_nb import kept, registry
from monarch_nb.errors import ClusterError

DEFAULT_IDLE = 2 * 3600.0  # seconds: --keep alone, keep=True
# A kept cluster no kernel holds keeps its GPUs until then: a month outlasts any real absence
# (a holiday, a conference), and a cluster forgotten is still given back within it.
MAX_IDLE = 30 * 86400.0
READY_WAIT = 300.0  # seconds for the host to start its workers (imports on a loaded machine)
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|d)?")
_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def idle_limit(keep: Any) -> float | None:
    """Seconds a kept cluster may go without a kernel before it shuts itself down, from
    ``keep`` (True: DEFAULT_IDLE; a number of seconds; text such as ``"90s"``, ``"30m"``,
    ``"2h"``, ``"1d"``), at most MAX_IDLE; None for False or None (not kept). A mistake is one
    ValueError."""
    if keep is None or keep is False:
        return None
    if keep is True:
        return DEFAULT_IDLE
    shown = _shown(keep)
    if isinstance(keep, int | float) and not isinstance(keep, bool):
        seconds = float(max(min(keep, 2 * MAX_IDLE), -1))  # 10**400 has no float; NaN stays
    else:
        m = _DURATION.fullmatch(str(keep).strip().lower())
        if m is None:
            raise ValueError(
                f"--keep takes an idle limit such as 90s, 30m, 2h or 1d, got {shown} "
                "(the cluster shuts itself down after that long without a kernel)"
            )
        seconds = float(m[1]) * _UNITS[m[2]]
    if not seconds > 0:  # NaN too
        raise ValueError(f"--keep: the idle limit must be more than 0 seconds, got {shown}")
    if seconds > MAX_IDLE:
        days = f"{MAX_IDLE / 86400:g}"
        raise ValueError(
            f"--keep: the idle limit can be at most {days}d ({days} days without a kernel), "
            f"got {shown}"
        )
    return seconds


def _shown(keep: Any) -> str:
    try:
        text = repr(keep)
    except ValueError:  # an int past Python's 4300 digits
        return "a number of over 4300 digits"
    return text if len(text) <= 40 else f"{text[:36]}...{text[-1]}"


def claim_name(name: str | None, taken: set[str]) -> tuple[str, int]:
    """The kept cluster's name and the descriptor that holds it (kept.claim_name's, for the
    host to keep): ``name``, refused in one line where it is malformed or another kept cluster
    has it (``taken``, or claimed by a host starting now), else the notebook's (``train`` for
    train.ipynb) or ``cluster``, with ``-2``, ``-3``... where that one is taken."""
    if name is not None:
        if not kept.NAME.fullmatch(name):
            raise ValueError(
                f"--name {name!r}: use up to 64 letters, digits, '.', '_' and '-', starting "
                "with a letter or digit"
            )
        fd = None if name in taken else _claim(name)
        if fd is None:
            raise ValueError(
                f"a kept cluster named {name} is running: %monarch attach {name} attaches "
                "to it, or give another --name"
            )
        return name, fd
    stem = os.path.splitext(os.path.basename(notebook() or ""))[0]
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._")[:56] or "cluster"
    base = base if kept.NAME.fullmatch(base) else "cluster"
    for n in range(1, 10_000):
        name = base if n == 1 else f"{base}-{n}"
        fd = None if name in taken else _claim(name)
        if fd is not None:
            return name, fd
    raise ValueError(f"kept clusters named {base} to {base}-9999 are running: give a --name")


def _claim(name: str) -> int | None:
    try:
        return kept.claim_name(name)
    except OSError as e:  # the runtime directory not writable, a symlink put there
        raise ClusterError(f"cannot claim the name {name} in {kept.kept_dir()}: {e}") from None


def notebook() -> str | None:
    """The notebook this kernel runs (Jupyter Server sets it in the kernel's environment)."""
    path = os.environ.get("JPY_SESSION_NAME")
    return path if kept._text(path) else None


def devices(plans) -> str:
    """What the ranks run on, until a controller has asked them (``2 cpu``, ``4 cuda``)."""
    gpus = [p.gpu for p in plans if p.gpu is not None]
    if not gpus:
        return f"{len(plans)} cpu"
    from monarch_nb.controller import cluster as clusters

    return f"{len(plans)} {clusters.detect_gpus().vendor or 'gpu'}"


# Run as ``python -c BOOT SYS_PATH READY_FD``: the kernel's sys.path first, so that the host and
# its workers import what the kernel imports (monarch_nb from a checkout included). The host's
# code (host/main.py) is named here, not imported: its folder is above this one.
BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from monarch_nb.host.main import main; main(int(sys.argv[2]))"
)


class Host:
    """A host process being started: wait with ``ready()``, stop with ``stop()``."""

    def __init__(
        self,
        plans,
        threads: int,
        tls: bool,
        idle: float,
        name: str,
        claim: int,
        dist: bool,
        ft: bool = False,
    ):
        """``claim``: the descriptor holding ``name`` (``claim_name``), which the host inherits
        and keeps open for as long as it runs; the caller closes its own."""
        self.id = uuid.uuid4().hex
        folder = kept.ensure_dir()
        spec = {
            "id": self.id,
            "name": name,
            "token": secrets.token_hex(16),
            "plans": [asdict(p) for p in plans],
            "threads": threads,
            "tls": tls,
            "idle_limit": idle,
            "dist": dist,
            "devices": devices(plans),
            "claim_fd": claim,
            "ft": ft,
        }
        fd = os.open(folder / f"{self.id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._ready, ready_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, json.dumps(sys.path), str(ready_w)],
                stdin=subprocess.PIPE,
                stdout=fd,
                stderr=fd,
                pass_fds=(ready_w, claim),
                start_new_session=True,  # out of reach of the kernel's process group
            )
        except BaseException:
            os.close(self._ready)
            raise
        finally:
            os.close(fd)
            os.close(ready_w)
        try:
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
        except OSError:  # it died at once; ready() says why
            pass

    def ready(self) -> dict[str, Any]:
        """The kept-cluster entry, checked, once the host says the cluster is up; a one-line
        ClusterError (the host's own words, or its log's last line) where it could not."""
        data = b""
        try:
            while not data.endswith(b"\n"):
                if not select.select([self._ready], [], [], READY_WAIT)[0]:
                    raise ClusterError(
                        f"the kept cluster's host did not start its workers within "
                        f"{READY_WAIT:g} s; its log: {kept.log_path(self.id)}"
                    )
                chunk = os.read(self._ready, 4096)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._ready)
        try:
            said = json.loads(data)
        except ValueError:
            said = {"ok": False, "error": self._last_words()}
        if not said.get("ok"):
            raise ClusterError(f"the kept cluster could not start: {said.get('error')}")
        try:
            entry = kept.load(self.id)
        except registry.InvalidEntry as e:
            raise ClusterError(f"the kept cluster's file is not to be trusted: {e}") from None
        if entry is None:
            raise ClusterError(f"the kept cluster's host left no file; its log: {self._log()}")
        # Reaped when it exits (down, its idle limit), whichever kernel asked it to
        threading.Thread(target=self.proc.wait, name="monarch-host-reaper", daemon=True).start()
        return entry

    def stop(self) -> None:
        """Shut the host (and so its workers) down, waiting for it."""
        with contextlib.suppress(OSError):
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(kept.STOP_WAIT)
            return
        self.proc.kill()
        self.proc.wait()

    def _log(self) -> str:
        return str(kept.log_path(self.id))

    def _last_words(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self.proc.wait(5)
            lines = kept.log_path(self.id).read_text(errors="replace").strip().splitlines()
            if lines:
                return f"{lines[-1][-300:]} (its log: {self._log()})"
        return f"its host exited without a word (its log: {self._log()})"
