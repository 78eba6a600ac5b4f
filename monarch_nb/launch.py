"""``%monarch run script.py``: an unmodified torchrun-style script on every rank.

Each rank starts the script as a child process with the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), inheriting the worker's GPU
pinning, and streams its output back like a cell's. An interrupt stops the children.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from . import children
from .dist import master_host
from .results import CellError, RemoteError, ValueMesh


class ScriptError(CellError):
    """The script exited non-zero on some ranks."""


def run_script(ctl, path: str, args: list[str], targets=None) -> ValueMesh:
    """Run ``path`` with ``args`` on the targeted ranks; a ValueMesh of exit codes (all zero)."""
    ranks = ctl.targets(targets)
    local = os.path.abspath(path)
    script = local if os.path.exists(local) else path
    addr = master_host(ctl.ranks[ranks[0]].address)
    port = ctl.call(_free_port, targets=[ranks[0]]).item()
    hosts = [ctl.ranks[r].host for r in ranks]
    per_rank = {}
    for i, r in enumerate(ranks):
        env = {
            "RANK": str(i),
            "WORLD_SIZE": str(len(ranks)),
            "LOCAL_RANK": str(hosts[:i].count(hosts[i])),
            "LOCAL_WORLD_SIZE": str(hosts.count(hosts[i])),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }
        per_rank[r] = (script, list(args), env)
    codes = ctl.call(_run, targets=ranks, per_rank=per_rank)
    failed = {r: c for r, c in codes.items() if c != 0}
    if failed:
        errors = {
            r: RemoteError(r, ctl.ranks[r].host, "ScriptExit", f"{path} exited with code {c}", [])
            for r, c in failed.items()
        }
        ok = ValueMesh({r: c for r, c in codes.items() if c == 0})
        raise ScriptError(
            errors, ok, ranks, f"{path} failed on {len(failed)} of {len(ranks)} ranks"
        )
    return codes


def _free_port(engine) -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(engine, script: str, args: list[str], env: dict[str, str]) -> int:
    if not os.path.exists(script):
        raise FileNotFoundError(f"no script at {script} on {engine.host}")
    proc = subprocess.Popen(
        [sys.executable, "-u", script, *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return children.finish(proc, sys.stdout.write, sys.stderr.write)
