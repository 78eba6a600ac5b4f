"""HSDP under torchft (``%monarch up --ft --mesh replicate=2,shard=2``, a model sharded with
``fully_shard`` over ``mesh["shard"]``): FSDP within each replica group, torchft across them.
A lost rank takes its replica group with it; the group comes back, its own process group and
mesh formed for the --setup cells, heals from a live group and finishes the loop."""

from __future__ import annotations

import re
import threading

import pytest
from _wait import wait_for

import monarch_nb
from monarch_nb.dispatch.results import CellError

pytest.importorskip("torchft")

SETUP = """\
import os, time, torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from monarch_nb import ft

def batch(step):  # each rank's own, whichever process runs it
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))

def fresh():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

model = fresh()
fully_shard(model, mesh=mesh["shard"])
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
setup_pid = os.getpid()
"""
TRAIN = """\
model, opt = ft.wrap(model, opt)
for step in ft.steps({steps}):
    opt.zero_grad()
    model(batch(step)).square().mean().backward()
    opt.step()
    time.sleep({pause})
full = [p.full_tensor().detach() for p in model.parameters()]
(ft.manager().current_step(), [float(t.sum()) for t in full], setup_pid == os.getpid())
"""
# The same model and batches under plain DDP over the 4 ranks: what HSDP must compute
DDP = """\
from torch.nn.parallel import DistributedDataParallel as DDP
m = fresh()
net, o = DDP(m), torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
for step in range({steps}):
    o.zero_grad()
    net(batch(step)).square().mean().backward()
    o.step()
[float(p.detach().sum()) for p in m.parameters()]
"""


@pytest.fixture(scope="module")
def hsdp(runtime):
    ctl = monarch_nb.up(workers=4, cpu=True, ft=True, mesh="replicate=2,shard=2", current=False)
    yield ctl
    ctl.down()


def test_hsdp_steps_are_those_of_ddp_over_every_rank(hsdp):
    """FSDP averages within a group, torchft across the groups: plain DDP over all 4 ranks."""
    hsdp.run(SETUP, setup=True, stream=False)
    result = hsdp.run(TRAIN.format(steps=12, pause=0), stream=False).values()
    reference = hsdp.run(DDP.format(steps=12), stream=False).values()
    assert [r[0] for r in result] == [12] * 4
    for got, want in zip([r[1] for r in result], reference, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def test_a_lost_rank_takes_its_replica_group_along_and_the_group_heals_and_finishes(hsdp, capsys):
    victim = 2  # its group's first: the group's Manager server and store go with it
    hsdp.run(SETUP, setup=True, stream=False)  # a fresh model over the mesh as it is now
    start = len(hsdp.ft_events)
    hsdp.ft_quorum.clear()

    def kill_at_step_30():
        wait_for(lambda: hsdp.ft_quorum.get("step", -1) >= 30, timeout=60, interval=0.02)
        hsdp.kill(victim)

    threading.Thread(target=kill_at_step_30, daemon=True).start()
    capsys.readouterr()
    result = hsdp.run(TRAIN.format(steps=100, pause=0.02)).values()
    assert [r[0] for r in result] == [100] * 4
    assert all(r[1] == result[0][1] for r in result)  # every rank holds the same model
    assert [r[2] for r in result] == [True] * 4  # the replacements ran the --setup cell
    events = sorted((e["rank"], e["event"]) for e in hsdp.ft_events[start:])
    assert events == sorted((r, e) for r in (2, 3) for e in ("lost", "joining", "healing", "back"))
    text = capsys.readouterr().err
    said = rf"rank {victim} lost at step \d+; its replica group \(ranks 2-3\) goes with it; 2 of 4"
    assert re.search(said, text), text
    # the cluster's group formed again before the next cell: the model is sharded again
    with pytest.raises(CellError) as e:
        hsdp.run(TRAIN.format(steps=101, pause=0), stream=False)
    assert {r: "sharded over a process group that is gone" in err.evalue
            for r, err in e.value.errors.items()} == dict.fromkeys(range(4), True)  # fmt: skip
    # the --setup cells again: the trained shards, optimizer state and step go on in the new
    hsdp.run(SETUP, setup=True, stream=False)
    again = hsdp.run(TRAIN.format(steps=100, pause=0)).values()  # no step to take: as it was
    assert again == result
    assert "[ranks 0-3] ft.wrap: the model trained before the process group formed again goes on " \
        "in this one, at step 100" in capsys.readouterr().out  # fmt: skip


BAD = {
    "fully_shard(fresh(), mesh=mesh)": "sharded over a 2-D mesh",
    "fully_shard(fresh(), mesh=mesh['replicate'])": "not a run of consecutive ranks",
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "fully_shard(fresh(), mesh=init_device_mesh('cpu', (4,)))": "sharded over all 4 ranks",
}


def test_shardings_torchft_cannot_replicate_are_one_line(hsdp):
    for shard, message in BAD.items():
        code = f"m = {shard}\nft.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))"
        if "\n" in shard:
            head, last = shard.rsplit("\n", 1)
            code = f"{head}\nm = {last}\nft.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))"
        with pytest.raises(CellError, match=re.escape(message)):
            hsdp.run(code, stream=False)
    with pytest.raises(CellError, match="min_replicas=3 is more than the 2 replica groups"):
        hsdp.run("ft.wrap(model, opt, min_replicas=3)", stream=False)
    assert hsdp.run("1", stream=False).values() == [1] * 4
