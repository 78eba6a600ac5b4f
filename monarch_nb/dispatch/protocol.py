"""What sending a request needs of the controller that sends it (controller/controller.py's
``Controller``, whose folder is above this one): its rank table, its links and its loop."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from monarch_nb.dispatch.host_relays import HostRelay
    from monarch_nb.dispatch.links import Link, RankInfo, Request, Router
    from monarch_nb.dispatch.reader import Reader
    from monarch_nb.dispatch.relaying import Relay


class Ctl(Protocol):
    """The controller as the dispatch folder uses it."""

    closed: bool
    ranks: list[RankInfo]
    unanswering: set[int]  # the ranks that did not answer when last asked
    _known: dict[int, dict[str, Any]]  # what each rank last said about itself
    _links: dict[int, Link]
    _relay: Relay | None  # where requests to many ranks on this host go (relaying.py)
    _host_relays: dict[str, HostRelay]  # the relays on other hosts by address (host_relays.py)
    _router: Router
    _reader: Reader
    _loop: asyncio.AbstractEventLoop
    _detached: bool  # a restart was interrupted: the ranks' requests ended with it

    def targets(self, spec=None) -> list[int]:
        """The ranks ``spec`` names (every rank for None)."""

    def _check_open(self) -> None:
        """Raise the ClusterError that says why no request can go now."""

    def _scheduler_gone(self) -> str:
        """What to say once the Dask client's loop has closed."""

    def _regroup_after_interrupt(self, req: Request, outcomes: dict[int, dict]) -> None:
        """Form the process group again where an interrupt left the ranks out of step."""

    def _interrupt_cut(self, req: Request) -> str | None:
        """What a ``--noblock`` cell's interrupt cuts as well (``send_interrupt``'s ``cut``)."""
