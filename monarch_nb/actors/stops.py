"""Ranks whose actor endpoint stopped in pdb, as their workers said (rank/debugger.py): the
caller's side, where a waiting ``get()`` or ``%monarch debug`` attaches to them."""

from __future__ import annotations

import threading


class _Stops:
    """Ranks whose actor endpoint stopped in pdb, as their workers said: a ``get()`` waiting on
    the notebook's main thread attaches to them (the notebook could not take ``%monarch debug``
    meanwhile)."""

    def __init__(self):
        self.ranks: set[int] = set()
        self.event = threading.Event()
        self.lock = threading.Lock()

    def note(self, rank: int) -> None:
        with self.lock:
            self.ranks.add(rank)
            self.event.set()

    def take(self) -> list[int]:
        with self.lock:
            ranks, self.ranks = sorted(self.ranks), set()
            self.event.clear()
        return ranks


stops = _Stops()
