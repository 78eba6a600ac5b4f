"""Ending a controller's workers: ``restart`` (fresh processes, the same ranks) and ``down``
(the connection closed, and the cluster with it where this controller started it)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from monarch_nb import registry
from monarch_nb.controller import attach
from monarch_nb.controller import cluster as clusters
from monarch_nb.dispatch.results import Interrupted
from monarch_nb.errors import ClusterError, current, set_current

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller


def restart(ctl: Controller) -> None:
    ctl._check_open()
    ctl._restarting = True  # a replacement in progress stands down: restart attaches all
    try:
        attach.close_links(ctl)
        ctl._detached = True
        for hook in ctl.restart_hooks:
            hook()
        nanny = logging.getLogger("distributed.nanny")  # in-process for a local cluster
        level = nanny.level
        nanny.setLevel(logging.ERROR)  # "Restarting worker": what was asked for
        try:
            ctl.client.restart(wait_for_workers=True)
        finally:
            nanny.setLevel(level)
        attach.reattach(ctl)
    except KeyboardInterrupt:
        # The scheduler goes on restarting the workers; the next use attaches to them.
        raise Interrupted(
            "interrupted while the workers restart; the next cell attaches to the new ones"
        ) from None
    finally:
        ctl._restarting = False


def down(ctl: Controller) -> None:
    if ctl.closed:
        return
    ctl.closed = True
    interrupted, error = False, None
    gone = clusters.scheduler_gone(ctl.client, ctl.cluster)  # closed quickly and quietly
    for step in (
        lambda: closing(ctl, None),
        lambda: registry.unregister(ctl),
        ctl.comms.close,
        ctl.metrics.close,
        lambda: attach.close_links(ctl),
        ctl._reader.stop,
        lambda: clusters.close_client(ctl.client, gone),
        lambda: (
            ctl.owns_cluster
            and ctl.cluster is not None
            and clusters.close_cluster(ctl.cluster, gone)
        ),
        lambda: ctl.ft is not None and ctl.ft.close(),
    ):
        try:
            step()
        except KeyboardInterrupt:  # finish going down: a half-closed cluster helps no one
            interrupted = True
        except Exception as e:
            error = error or e
    if current() is ctl:
        set_current(None)
    if error is not None:
        raise error
    if interrupted:
        done = "the cluster was shut down" if ctl.owns_cluster else "disconnected"
        raise Interrupted(f"%monarch down was interrupted; {done} all the same")


def kill(ctl: Controller, rank: int) -> None:
    ctl._check_open()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ctl.world_size:
        raise ClusterError(
            f"no rank {rank!r} to kill: this cluster's ranks are 0 to {ctl.world_size - 1}"
        )
    info = ctl.ranks[rank]
    if not info.alive:
        raise ClusterError(f"rank {rank} has no worker now (it was lost and waits for one)")
    # Through the worker's own event loop: the worker may be on another host. No reply comes.
    ctl.client.run(_sigkill_self, workers=[info.address], wait=False)


async def _sigkill_self() -> None:  # a coroutine: the worker runs it without a reply
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def closing(ctl: Controller, why: str | None) -> None:
    """What the folders above put in ``closing_hooks`` closes first (the actors' mailbox)."""
    for hook in list(ctl.closing_hooks.values()):
        hook(ctl, why)
