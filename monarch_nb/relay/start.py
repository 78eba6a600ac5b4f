"""Starting this host's relay (host.py), in a worker's process, when the controller asks.

The controller asks one worker on each host other than its own (``Client.run``, from
controller/attach.py; dispatch/host_relays.py speaks to the relay). The relay listens on that
worker's address for the one controller that presents ``token``, and ends when that
controller's connection does. It is a session of its own, so that a signal to the worker's
process group leaves it be; this worker reaps it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from monarch_nb.relay import host as relay_host

START_WITHIN = 10.0  # seconds for the relay to say where it listens


def start(token: str, dask_worker=None) -> dict[str, int]:
    """Start a relay on this worker's host: ``{"port": ..., "pid": ...}``."""
    address = dask_worker.address if dask_worker is not None else "tcp://127.0.0.1:0"
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
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
    proc.stdin.write(token.encode() + b"\n")
    proc.stdin.close()
    said: list[bytes] = []
    reading = threading.Thread(target=lambda: said.append(proc.stdout.readline()), daemon=True)
    reading.start()
    reading.join(START_WITHIN)
    if not said or not said[0]:
        proc.kill()
        proc.wait()
        reading.join()  # the kill ended its read
        proc.stdout.close()
        raise RuntimeError(f"the relay did not start within {START_WITHIN:g} s on {host}")
    proc.stdout.close()
    threading.Thread(target=proc.wait, daemon=True, name="monarch-relay-reaper").start()
    where = json.loads(said[0])
    return {"port": int(where["port"]), "pid": int(where["pid"])}
