"""Waiting for workers to join the scheduler: ``up`` and ``connect`` wait for the first ones,
``scale`` for the ones it added. Either way a noticeable wait is said once, and a wait that runs
out names the batch jobs that have not joined with their state (cluster.py's
``jobs_not_joined``: a partition that is down, a request no node fits)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from monarch_nb.controller import cluster as clusters
from monarch_nb.errors import ClusterError


def wait_for_workers(
    client,
    need: int,
    wait: float,
    cluster=None,
    *,
    there: Iterable = (),
    new: str = "",
    longer: str = "; --wait S (wait=S) waits longer",
    stop: str = "interrupt to stop",
    failed=None,
    after: str = "",
) -> dict[str, dict]:
    """The workers that joined (address -> the scheduler's info), once there are ``need`` of
    them besides the ranks ``there`` (RankInfos), within ``wait`` seconds. A worker under the
    name of a rank there is that rank's replacement (attach.py), not one more worker. ``new``,
    ``longer`` and ``stop`` are the caller's words: what the workers are ("new "), what follows
    a wait that ran out, how to stop waiting. ``failed()``, where given, says why the workers
    cannot all come (one failed to start): the wait ends at once, with ``after`` appended."""
    addresses = {info.address for info in there}
    names = {info.name for info in there}
    start, told = time.monotonic(), False
    while True:
        workers = clusters.workers(client)
        joined = {
            addr: w
            for addr, w in workers.items()
            if addr not in addresses and w.get("name", addr) not in names
        }
        if len(joined) >= need:
            return joined
        why = failed() if failed is not None else None
        if why is not None:
            raise ClusterError(why + after)
        waited = time.monotonic() - start
        if waited > wait:
            jobs = clusters.jobs_not_joined(cluster, {w.get("name") for w in workers.values()})
            raise ClusterError(
                f"only {len(joined)} of {need} {new}workers joined within {wait:g} s"
                + (f" ({jobs})" if jobs else "")
                + longer
            )
        if not told and waited > 2:
            print(
                f"monarch-nb: {len(joined)} of {need} {new}workers have joined; waiting up to "
                f"{wait:g} s for the rest ({stop})",
                file=sys.stderr,
            )
            told = True
        time.sleep(0.05)
