"""``%monarch run script.py``: an unmodified torchrun-style script on every rank; ``-m module``
runs a module of a package the ranks have, as ``python -m`` and ``torchrun -m`` do.

Each rank starts the script as a child process with the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and streams its output back
like a cell's. An interrupt stops the children, and so does another rank's script failing: the
others' scripts are then waiting for it in a collective, in their own processes, and are ended
(dispatch/releasing.py), as torchrun ends a job's workers when one fails.

GPUs: torchrun's processes each see all of the node's GPUs and pick theirs with
``torch.cuda.set_device(LOCAL_RANK)``, but a worker sees only its own GPU. So where every rank
of a host is pinned to one GPU, each script sees the host's pinned GPUs in local-rank order: GPU
LOCAL_RANK is the rank's own, as under torchrun.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

from monarch_nb.controller.dist import master_host
from monarch_nb.dispatch import dispatch
from monarch_nb.dispatch.results import CellError, RemoteError, ValueMesh
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.rank import children

# The variables that narrow which GPUs a process sees: AMD's runtime, HIP, CUDA.
VISIBILITY = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class ScriptError(CellError):
    """The script exited non-zero on some ranks."""


def run_script(ctl, path: str, args: list[str], targets=None, module: bool = False) -> ValueMesh:
    """Run ``path`` with ``args`` on the targeted ranks (``module``: ``path`` names a module, run
    as ``python -m``); a ValueMesh of exit codes (all zero)."""
    ranks = ctl.targets(targets)
    local = os.path.abspath(path)
    script = local if not module and os.path.exists(local) else path
    addr = master_host(ctl.ranks[ranks[0]].address)
    port = ctl.call(_free_port, targets=[ranks[0]]).item()
    hosts = [ctl.ranks[r].host for r in ranks]
    pins = ctl.call(_pins, targets=ranks)
    visible = host_visibility(hosts, [pins[r] for r in ranks])
    per_rank = {}
    for i, r in enumerate(ranks):
        env = {
            "RANK": str(i),
            "WORLD_SIZE": str(len(ranks)),
            "LOCAL_RANK": str(hosts[:i].count(hosts[i])),
            "LOCAL_WORLD_SIZE": str(hosts.count(hosts[i])),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            **visible[i],
        }
        per_rank[r] = (script, list(args), env, module)
    try:
        return dispatch.call(ctl, _run, targets=ranks, per_rank=per_rank, release="children")
    except CellError as e:
        raise _script_error(path, e) from None


class ScriptExit(Exception):
    """Raised on a rank whose script exited non-zero: a failure, which releases the others."""


def _script_error(path: str, e: CellError) -> ScriptError:
    errors = {
        r: RemoteError(r, err.host, "ScriptExit", f"{path} {err.evalue}", [])
        if err.ename == "ScriptExit"
        else err
        for r, err in e.errors.items()
    }
    failed = [r for r, err in errors.items() if err.ename != "Released"]
    released = [r for r in errors if r not in failed]
    headline = f"{path} failed on {len(failed)} of {len(e.targets)} ranks"
    if e.cause is not None:
        headline = f"{path} failed on rank {e.cause}: {errors[e.cause].evalue}"
    if released:
        headline += f" ({format_ranks(released)} released)"
    others = [r for r in failed if r != e.cause]
    if e.cause is not None and others:  # of themselves, after it (their peer had gone)
        headline += f"; {format_ranks(others)} failed too"
    return ScriptError(errors, e.results, e.targets, headline, cause=e.cause)


def host_visibility(hosts: list[str], pins: list[dict[str, str]]) -> list[dict[str, str]]:
    """The GPU visibility variables each rank's script gets, ranks in launch order: for each
    variable that pins every rank of a host to a GPU of its own (one entry, none shared), the
    host's entries in local-rank order. Ranks not pinned that way keep what they have."""
    out: list[dict[str, str]] = [{} for _ in hosts]
    for host in dict.fromkeys(hosts):
        mine = [i for i, h in enumerate(hosts) if h == host]
        if len(mine) < 2:
            continue
        for var in VISIBILITY:
            entries = [pins[i].get(var, "") for i in mine]
            single = all(e and "," not in e for e in entries)
            if single and len(set(entries)) == len(entries):
                for i in mine:
                    out[i][var] = ",".join(entries)
    return out


def _pins(engine) -> dict[str, str]:
    return {var: os.environ[var] for var in VISIBILITY if var in os.environ}


def _free_port(engine) -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(engine, script: str, args: list[str], env: dict[str, str], module: bool = False) -> int:
    if module:
        try:
            found = importlib.util.find_spec(script) is not None
        except ImportError:  # its package is missing
            found = False
        if not found:
            raise ModuleNotFoundError(f"no module named {script!r} on {engine.host}")
        command = [sys.executable, "-u", "-m", script]
    elif not os.path.exists(script):
        raise FileNotFoundError(f"no script at {script} on {engine.host}")
    else:
        command = [sys.executable, "-u", script]
    code = children.run([*command, *args], env={**os.environ, **env})
    if code != 0:
        raise ScriptExit(f"exited with code {code}")
    return code
