"""PyTorch Monarch's code in notebook cells (a real IPython shell): ``this_host().spawn_procs``
starts the notebook's cluster where none is up, its meshes are that cluster's ranks (the
sidebar's entry, ``%monarch status``, the live panel), it grows for a larger mesh, and what the
actors print is tagged as actor output is."""

from __future__ import annotations

from _wait import wait_for

import monarch_nb
from monarch_nb import registry

ACTOR = """\
from monarch_nb.actor import Actor, current_rank, endpoint, this_host

class Greeter(Actor):
    @endpoint
    def hello(self, who):
        print(f"hello {who} from {current_rank()}")
        return current_rank().rank
"""


def test_monarch_code_in_cells_runs_on_the_notebooks_cluster(cell, no_current):
    cell(ACTOR)
    cell("procs = this_host().spawn_procs(per_host={'gpus': 2})")
    ctl = monarch_nb.current()
    assert ctl is not None and ctl.world_size == 2 and ctl.owns_cluster
    cell("greeters = procs.spawn('greeters', Greeter)\ngreeters.hello.call('cells').get()")
    assert "[greeters rank 0] hello cells from {'gpus': 0/2}" in cell.out
    assert "[greeters rank 1] hello cells from {'gpus': 1/2}" in cell.out
    cell("%monarch status")
    assert cell.out.count("idle") == 2
    [entry] = [e for e in registry.list_entries() if e["id"] == ctl.id]
    assert entry["ranks"] == 2  # the sidebar's
    cell("%%monarch\nfrom monarch_nb import log\nlog(step=0, loss=1.5 + rank)")
    cell("%monarch dashboard")  # the live panel, as text here: this shell has no kernel
    assert wait_for(lambda: "2.5" in (cell("%monarch dashboard") or cell.out))
    cell("wider = this_host().spawn_procs(per_host={'gpus': 3})")  # the cluster grows for it
    assert ctl.world_size == 3 and monarch_nb.current() is ctl
    cell("wide = wider.spawn('wide', Greeter)\nsorted(wide.hello.call('three').get().values())")
    assert "[wide rank 2] hello three from {'gpus': 2/3}" in cell.out
    cell("%monarch down")
    assert "cluster shut down" in cell.out
