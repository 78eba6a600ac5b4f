"""Waiting for the ranks' setup, the first request a controller sends each rank.

A setup may rightly take long (importing torch, starting a GPU) or wait behind another
controller's cell on the same worker, but one that can never complete must not hang the
notebook. A rank silent for ``PROBE_EVERY`` seconds is asked what it does, on its control
comm, which its worker's event loop answers even while the rank's thread is busy: running the
setup or another request, it is waited for (up to ``SETUP_TIMEOUT``); idle twice in a row
without having seen the setup, the request was lost on the way; silent twice, its worker is
not answering at all. Either of the last two ends the wait with one line naming the rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from monarch_nb.dispatch import gathering
from monarch_nb.dispatch.links import Request
from monarch_nb.dispatch.output import Renderer

SETUP_TIMEOUT = 300.0  # a setup that runs (or waits behind a running cell) gets this long
PROBE_EVERY = 5.0  # seconds of silence before a rank is asked what it does
ANSWER_WITHIN = 10.0  # its worker's event loop answers at once, unless the machine crawls


def wait_for_setup(setup: Request, ask: Callable[[list[int]], Request]) -> dict[int, dict]:
    """The ranks' answers to ``setup``; a rank that cannot answer gets an ``unanswered``
    outcome saying why. ``ask(ranks)`` sends those ranks an info request about ``setup``."""
    outcomes: dict[int, dict] = {}
    deadline = time.monotonic() + SETUP_TIMEOUT
    before: dict[int, str] = {}  # rank -> "idle" / "silent": what the last probe found
    doing: dict[int, str] = {}
    while True:
        with contextlib.suppress(TimeoutError):
            until = min(deadline, time.monotonic() + PROBE_EVERY)
            gathering.gather(setup, Renderer(setup.ranks), until, outcomes)
            return outcomes
        silent = [r for r in setup.ranks if r not in outcomes]
        if time.monotonic() >= deadline:
            for rank in silent:
                outcomes[rank] = _unanswered(
                    f"its setup did not finish within {SETUP_TIMEOUT:.0f} s "
                    f"({doing.get(rank, 'no answer')})"
                )
            return outcomes
        probe = ask(silent)
        answers: dict[int, dict] = {}
        with contextlib.suppress(TimeoutError):
            gathering.gather(probe, Renderer(silent), time.monotonic() + ANSWER_WITHIN, answers)
        # An answer comes on the same connection as the setup's, after it if it was sent.
        with contextlib.suppress(TimeoutError):
            gathering.gather(setup, Renderer(setup.ranks), time.monotonic() + 0.2, outcomes)
        now: dict[int, str] = {}
        for rank in silent:
            if rank in outcomes:
                continue
            ev = answers.get(rank)
            info = ev["info"] if ev is not None and ev.get("status") == "ok" else None
            if info is None:
                now[rank] = "silent"  # asked again: its connection may still be opening
                doing[rank] = "not answering"
            elif info.get("about") == "running":
                doing[rank] = "still running it: importing torch or starting its device"
            elif info.get("current") is not None or info.get("queued"):
                doing[rank] = f"waiting behind request {info.get('current')} that still runs"
            else:
                now[rank] = "idle"  # its answer to the setup may be on its way: asked again
            if rank in now and before.get(rank) == now[rank]:
                outcomes[rank] = _unanswered(_why(now[rank]))
        before = now
        if len(outcomes) == len(setup.ranks):
            return outcomes


def _why(found: str) -> str:
    if found == "idle":
        return (
            "its engine is idle and never received the setup request: the data connection "
            "lost it; connect again"
        )
    return (
        f"neither its setup nor two status requests were answered (each given "
        f"{ANSWER_WITHIN:.0f} s): its worker is stopped or hung, or the connection to it is "
        "broken; %monarch restart starts fresh workers"
    )


def _unanswered(why: str) -> dict:
    return {"ev": "done", "status": "unanswered", "why": why}
