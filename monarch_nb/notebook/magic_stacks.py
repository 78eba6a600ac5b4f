"""``%monarch stacks``: what every rank's threads are doing right now, asked while a cell runs
or hangs (a ``--noblock`` cell that never ends, say). ``fn(magics, args)`` as every command."""

from __future__ import annotations

from IPython.core.error import UsageError

from monarch_nb.controller import stacks as controller_stacks
from monarch_nb.errors import ClusterError
from monarch_nb.notebook.magic_cluster import controller, guard


def stacks(magics, args):
    """Every thread's stack on the targeted ranks, identical ones grouped::

    In [5]: %%monarch --noblock
       ...: dist.all_reduce(t) if rank != 1 else time.sleep(600)
    In [6]: %monarch stacks
    stacks of ranks 0-3 (4 answered in 21 ms)
    ranks 0,2,3 wait in all_reduce #57; rank 1 is at #56, in cell 5, line 1
    ...
    """
    ctl = controller()
    ranks = guard(lambda: ctl.targets(args.targets))
    try:
        report = controller_stacks.ask(ctl, ranks, native=args.native)
    except ClusterError as e:  # the scheduler went away meanwhile
        raise UsageError(str(e)) from None
    report.everything = args.all
    return report
