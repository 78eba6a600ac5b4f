"""``%monarch interrupt`` (``ctl.interrupt(wait=True)``): the interrupt sent, then what became of
each rank, as honestly as a Ctrl-C reports it. A KeyboardInterrupt raised in a rank's thread lands
only between two bytecodes, so a cell in a long C call (``time.sleep(15)``, a blocking
collective) goes on; the command used to say "interrupted" all the same, and the next cell
waited the whole sleep behind it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monarch_nb.dispatch import dispatch, unanswered
from monarch_nb.dispatch.targets import format_ranks

if TYPE_CHECKING:
    from monarch_nb.dispatch.protocol import Ctl

POLL = 0.05  # seconds between two looks at what the interrupted ranks run


@dataclass(frozen=True)
class Interruption:
    """What an interrupt did, rank by rank: the cells it stopped, those still running after
    the grace, the ranks that were running nothing, and those that did not answer."""

    stopped: tuple[int, ...] = ()
    busy: tuple[int, ...] = ()
    idle: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()
    why_silent: str = ""  # the first silent rank's reason (unanswered.py)

    @property
    def troubled(self) -> bool:
        """Some rank goes on running, or did not answer."""
        return bool(self.busy or self.silent)

    def __str__(self) -> str:
        parts = []
        if self.stopped:
            parts.append(f"interrupted {format_ranks(self.stopped)}")
        if self.busy:
            one = len(self.busy) == 1
            parts.append(
                f"{format_ranks(self.busy)} {'is' if one else 'are'} still busy: "
                f"{'its' if one else 'their'} cell did not stop within "
                f"{dispatch.INTERRUPT_GRACE:g} s of the interrupt (stuck in a C call, such as a "
                "long time.sleep?); %monarch interrupt again, or %monarch restart for fresh "
                "workers"
            )
        if self.silent:
            if len(self.silent) == 1:
                parts.append(f"rank {self.silent[0]} is {self.why_silent}")
            else:
                parts.append(
                    f"{format_ranks(self.silent)} are not answering (stopped, or a C call holds "
                    "the GIL; %monarch status names their pids)"
                )
        if self.idle:
            were = "was" if len(self.idle) == 1 else "were"
            parts.append(f"{format_ranks(self.idle)} {were} running nothing")
        return "; ".join(parts)


def interrupt(ctl: Ctl, ranks: list[int]) -> Interruption:
    """Interrupt whatever ``ranks`` run and wait, up to the grace a Ctrl-C gives, for it to
    stop. Asked behind the interrupt on the same comm, a rank's first answer names the request
    the interrupt hit there (it may have ended already: the interrupt's direct path is faster
    than the comm); it has stopped once the rank runs another, or none."""
    press = dispatch.send_interrupt(ctl, ranks)
    first = dispatch.rank_info(ctl, ranks, timeout=dispatch.ANSWER_WITHIN, press=press)
    hit = {r: ev["info"]["hit"] for r, ev in first.items() if ev["info"]["hit"]}
    idle = tuple(r for r in ranks if r in first and r not in hit)
    running = {r: cell for r, cell in hit.items() if first[r]["info"]["current"] == cell}
    silent = tuple(r for r in ranks if r not in first)
    deadline = time.monotonic() + dispatch.INTERRUPT_GRACE
    while running and time.monotonic() < deadline:
        time.sleep(POLL)
        now = dispatch.rank_info(ctl, list(running), timeout=dispatch.ANSWER_WITHIN)
        for rank, ev in now.items():
            if ev["info"]["current"] != running[rank]:
                del running[rank]
    stopped = tuple(r for r in ranks if r in first and r not in idle and r not in running)
    known = ctl._known.get(silent[0], {}) if silent else {}
    why = unanswered.why(known.get("pid"), known.get("host")) if silent else ""
    return Interruption(stopped, tuple(sorted(running)), idle, silent, why)
