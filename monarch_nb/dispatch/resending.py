"""The cells and calls sent through a relay, kept while they may be unfinished: if the relay
ends, they are sent again directly (relaying.py's local relay, host_relays.py's on other hosts),
and an engine that had them drops the second copy (rank/engine_io.py's ``Channel.fresh``)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch_nb.wire import RESENT_OPS

if TYPE_CHECKING:
    from monarch_nb.dispatch.links import Link, Router


class Unfinished:
    """Request id -> (links, message) of the cells and calls sent through one relay."""

    def __init__(self, router: Router):
        self.router = router
        self.sent: collections.OrderedDict[str, list[tuple[list[Link], dict]]] = (
            collections.OrderedDict()
        )

    def keep(self, links: list[Link], msg: dict[str, Any]) -> None:
        """(Under the relay's lock.) ``msg`` went to ``links``; the finished ones are let go."""
        if msg.get("op") not in RESENT_OPS:
            return
        live, sent = self.router.live, self.sent
        while sent and next(iter(sent)) not in live:
            sent.popitem(last=False)
        sent.setdefault(msg["id"], []).append((links, msg))

    def send_again(self, reachable: Callable[[Link], bool] = lambda link: True) -> None:
        """(Under the relay's lock, ended.) Each to the ranks still running it, directly, in the
        order they were sent."""
        live = self.router.live
        for request_id, entries in self.sent.items():
            req = live.get(request_id)
            if req is None:
                continue
            for links, msg in entries:
                again = {**msg, "resent": True}
                for link in links:
                    if link.info.rank in req.remaining and reachable(link):
                        link.send_direct(again)
        self.sent.clear()
