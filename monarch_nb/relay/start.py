"""Starting this host's relay (host.py), in a worker's process, when the controller asks.

The controller asks one worker on each host other than its own (``Client.run``, from
controller/attach.py; dispatch/host_relays.py speaks to the relay). The relay listens on that
worker's address for the one controller that presents ``token``, and ends when that
controller's connection does. It is a session of its own, so that a signal to the worker's
process group leaves it be; this worker reaps it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from typing import Any

from monarch_nb.relay import host as relay_host
from monarch_nb.wire import host_of

START_WITHIN = 10.0  # seconds for the relay to say where it listens


def start(token: str, dask_worker=None) -> dict[str, int]:
    """Start a relay on this worker's host: ``{"port": ..., "pid": ...}``."""
    address = dask_worker.address if dask_worker is not None else "tcp://127.0.0.1:0"
    host = host_of(address)
    return spawn(host, token)


def spawn(host: str, token: str, prefix: tuple[str, ...] = ()) -> dict[str, int]:
    """The relay process, listening on ``host``; ``prefix`` runs it elsewhere (a benchmark's
    simulated host: ``nsenter`` into its network namespace)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-I", "-S", relay_host.__file__, host],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    with contextlib.suppress(BrokenPipeError):  # (one that exited at once: said below)
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.close()
    said = json_line(proc, START_WITHIN)
    proc.stdout.close()
    if said is None:
        timed_out = proc.returncode == -signal.SIGKILL  # (json_line's kill)
        why = f"did not start within {START_WITHIN:g} s" if timed_out else "exited"
        raise RuntimeError(f"the relay {why} on {host}, before it said where it listens")
    threading.Thread(target=proc.wait, daemon=True, name="monarch-relay-reaper").start()
    return {"port": int(said["port"]), "pid": int(said["pid"])}


def json_line(proc: subprocess.Popen, timeout: float) -> Any:
    """The next line ``proc`` prints, read as JSON, within ``timeout`` seconds; None where it
    prints none (then it is killed: its reader ends with it)."""
    said: list = []
    reading = threading.Thread(target=lambda: said.append(proc.stdout.readline()), daemon=True)
    reading.start()
    reading.join(timeout)
    if said and said[0]:
        return json.loads(said[0])
    proc.kill()
    proc.wait()
    reading.join()
    return None
