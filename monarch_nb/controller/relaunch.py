"""Starting again the workers of lost ranks that nothing replaces: ``%monarch scale N`` at the
same size, on a cluster whose lost workers no nanny starts again (a batch job whose node died).
Each new worker has the lost one's name, so it takes the rank's place as a nanny's replacement
does (attach.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from monarch_nb.controller import attach
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.errors import ClusterError

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller


def start_again(ctl: Controller, ranks: list[int], wait: float) -> list[int]:
    """Workers for ranks whose worker is gone and was not replaced (a batch job whose node
    died: no nanny starts it again), under their names, so each takes its rank's place as a
    nanny's replacement does (attach.py); the caller forms the process group again. A
    SpecCluster (``up``'s, dask-jobqueue's) drops the lost worker's spec and adds it back,
    which starts a new worker or job."""
    from distributed import SpecCluster

    cluster = ctl.cluster
    olds = {rank: ctl.ranks[rank] for rank in ranks}
    specs = getattr(cluster, "worker_spec", None) or {}
    missing = [r for r, info in olds.items() if info.name not in specs]
    if not isinstance(cluster, SpecCluster) or missing:
        raise ClusterError(
            f"{format_ranks(missing or ranks)} lost {'its' if len(ranks) == 1 else 'their'} "
            f"worker and the cluster ({type(cluster).__name__}) cannot start one under its name; "
            "%monarch restart starts fresh workers for every rank"
        )
    for info in olds.values():
        spec = specs[info.name]
        cluster.sync(cluster.scale_down, [info.name])  # closes what is left of the old one
        cluster.worker_spec[info.name] = spec
    cluster.sync(cluster._correct_state)
    deadline = time.monotonic() + wait
    late = [
        r for r, info in olds.items() if not attach.replace(ctl, r, info, deadline, regroup=False)
    ]
    if late:
        raise ClusterError(
            f"no new worker for {format_ranks(late)} joined within {wait:g} s (wait=S waits "
            "longer; the cluster's log says why a worker or job did not start)"
        )
    return ranks
