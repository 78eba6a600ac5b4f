"""``%monarch debug``: pdb on a rank's traceback after a failed ``%%monarch`` cell, driven from
the notebook's input box; and the hint a plain ``%debug`` gives after such a cell (its
traceback is the controller's, not the rank's). ``fn(magics, args)`` as every command."""

from __future__ import annotations

import sys

from IPython.core.error import UsageError

from monarch_nb.actors.stops import stops
from monarch_nb.actors.wire import ActorError
from monarch_nb.dispatch import prompting
from monarch_nb.dispatch.results import CellError
from monarch_nb.notebook.magic_cluster import controller, guard

NO_FAILED_CELL = (
    "no %%monarch cell has failed on this cluster yet, and no rank waits in the debugger: "
    "nothing to debug"
)
USE_MONARCH_DEBUG = (
    "the last error came from the ranks: %monarch debug [--rank R] opens pdb on a rank's "
    "traceback (%debug would debug the notebook's own frames)"
)


def debug(magics, args):
    """Attach to a rank waiting in pdb in a ``--noblock`` cell; else pdb on the traceback of
    the last failed cell, on ``--rank R`` (default: the lowest that failed), or of the actor
    call whose ``ActorError`` the notebook raised last; ``q`` ends it and the rank keeps its
    namespace::

    In [7]: %monarch debug --rank 1
    [rank 1] ZeroDivisionError: division by zero
    [rank 1] > <monarch cell 6>(3)scale()
    (Pdb rank 1) p x
    [rank 1] 0
    (Pdb rank 1) q
    """
    ctl = controller()
    if guard(lambda: prompting.attach(ctl, args.rank)):
        return  # a background cell's rank waited in pdb
    stopped = stops.take()  # ranks where an actor endpoint waits in pdb
    chosen = next((r for r in stopped if args.rank in (None, r)), None)
    for rank in set(stopped) - {chosen}:
        stops.note(rank)  # still waiting
    if chosen is not None and guard(lambda: prompting.attach_actor(chosen)):
        return
    last = getattr(sys, "last_value", None)
    if args.rank is None and isinstance(last, ActorError) and last.post_mortem is not None:
        guard(last.debug)  # the notebook's latest error came from an endpoint
        return
    if ctl.last_failure is None:
        raise UsageError(NO_FAILED_CELL)
    guard(lambda: ctl.last_failure.debug(args.rank, latest=True))


def debug_cell(magics, line: str, cell: str) -> None:
    """``%%monarch debug [--rank R]``: the same, with the cell's lines typed at the prompts in
    turn (a notebook that shows a debugging session runs unattended)::

    %%monarch debug --rank 1
    p x
    up
    q
    """
    try:
        args = magics.parser.parse_argstring(line)
    except SystemExit:  # -h printed the help
        return
    commands = [c.strip() for c in cell.splitlines() if c.strip()]
    with prompting.scripted(commands):
        debug(magics, args)


def install_hint(shell) -> None:
    """``%debug`` (and ``%pdb`` post-mortems) after a failed %%monarch cell say to use
    ``%monarch debug`` instead of debugging the controller's frames."""
    if getattr(shell.debugger, "_monarch_hint", False):
        return
    original = shell.debugger

    def debugger(force=False):
        if force and isinstance(getattr(sys, "last_value", None), (CellError, ActorError)):
            print(USE_MONARCH_DEBUG, file=sys.stderr)
            return None
        return original(force)

    debugger._monarch_hint = True
    debugger._monarch_original = original
    shell.debugger = debugger


def remove_hint(shell) -> None:
    original = getattr(shell.debugger, "_monarch_original", None)
    if original is not None:
        shell.debugger = original
