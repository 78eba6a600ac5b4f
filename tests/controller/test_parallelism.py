"""Every parallelism from ``%%monarch`` cells on a device mesh: FSDP2 over ``dp``, tensor
parallelism over ``tp``, the two together, and pipeline stages (GPipe, 1F1B). Each run's losses
must equal a single-process run of the same model on the same data (fp32), computed here in the
test's process from the same source the ranks ran. Real gloo groups, 2 and 4 worker processes."""

from __future__ import annotations

import _thread
import threading

import pytest

from monarch_nb import CellError
from monarch_nb.controller import dist

STEPS = 5
# The model, the data and the single-process reference: run on every rank and here.
MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.hd = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1: the heads this rank holds, all of them unsharded, dim / hd / tp under TP
        q, k, v = (f(x).view(b, t, -1, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

class Block(nn.Module):
    """A transformer block: attention and an MLP, each after a layer norm."""
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))

def block_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())

def mlp(width=16, layers=4):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)))

def data(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)

def reference(model, x, y, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

def train(model, x, y, steps, dp=None):
    """SGD on this rank's share of the batch (its place on ``dp``); the batch's mean loss."""
    import torch.distributed as dist
    import monarch_nb
    if dp is not None:
        n, i = dp.size(), dp.get_local_rank()
        x, y = x.chunk(n)[i], y.chunk(n)[i]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        if dp is not None:
            dist.all_reduce(mean, group=dp.get_group())
            mean /= dp.size()
        monarch_nb.log(step=step, loss=mean)
        losses.append(mean.item())
    return losses
'''

TP_PLAN = """
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
plan = {}
for i in range(2):
    plan.update({f"{i}.attn.{p}": ColwiseParallel() for p in "qkv"})
    plan.update({f"{i}.attn.o": RowwiseParallel(), f"{i}.up": ColwiseParallel(),
                 f"{i}.down": RowwiseParallel()})
"""


def _reference(build: str, shape: tuple) -> list[float]:
    space: dict = {}
    exec(MODELS, space)
    x, y = space["data"](shape)
    return space["reference"](space[build](), x, y, STEPS)


def _same(ran, expected: list[float]) -> None:
    for rank, losses in ran.items():
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6), f"rank {rank}"


@pytest.fixture
def mesh2(clean):
    """The shared 2-rank cluster with the mesh the test sets, dropped after."""
    yield clean
    clean.set_mesh(None)


def test_fsdp_on_2_ranks_equals_one_process(mesh2):
    mesh2.set_mesh("dp=2")
    mesh2.run(MODELS)
    ran = mesh2.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "model = mlp()\n"
        "for layer in model:\n    fully_shard(layer, mesh=mesh['dp'])\n"
        "fully_shard(model, mesh=mesh['dp'])\n"
        "shards = [type(p).__name__ + str(tuple(p.to_local().shape)) for p in model.parameters()]\n"
        f"train(model, *data((8, 16)), {STEPS}, dp=mesh['dp'])"
    )
    _same(ran, _reference("mlp", (8, 16)))
    # each rank holds half of every weight's rows
    assert mesh2.pull("shards").item(0)[:2] == ["DTensor(8, 16)", "DTensor(8,)"]
    history = mesh2.metrics.history()
    assert sorted(r for r in history if history[r]) == [0, 1]


def test_fsdp_on_4_ranks_equals_one_process(mesh4):
    mesh4.set_mesh("dp=4")
    mesh4.run(MODELS)
    ran = mesh4.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "model = mlp()\n"
        "for layer in model:\n    fully_shard(layer, mesh=mesh['dp'])\n"
        "fully_shard(model, mesh=mesh['dp'])\n"
        f"train(model, *data((8, 16)), {STEPS}, dp=mesh['dp'])"
    )
    _same(ran, _reference("mlp", (8, 16)))


def test_tensor_parallel_block_equals_one_process(mesh4):
    mesh4.set_mesh("tp=4")
    mesh4.run(MODELS + TP_PLAN)
    ran = mesh4.run(
        "model = parallelize_module(block_model(), mesh['tp'], plan)\n"
        "heads = model[0].attn.q.weight.to_local().shape[0] // model[0].attn.hd\n"
        f"train(model, *data((2, 6, 32)), {STEPS})"
    )
    _same(ran, _reference("block_model", (2, 6, 32)))
    assert mesh4.pull("heads").values() == [1, 1, 1, 1]  # 4 heads, one on each rank


def test_fsdp_over_dp_and_tensor_parallel_over_tp(mesh4):
    mesh4.run(MODELS + TP_PLAN)  # dp=2,tp=2
    ran = mesh4.run(
        "from torch.distributed.fsdp import fully_shard\n"
        "model = parallelize_module(block_model(), mesh['tp'], plan)\n"
        "for block in model:\n    fully_shard(block, mesh=mesh['dp'])\n"
        "fully_shard(model, mesh=mesh['dp'])\n"
        f"train(model, *data((4, 6, 32)), {STEPS}, dp=mesh['dp'])"
    )
    _same(ran, _reference("block_model", (4, 6, 32)))


PIPELINE = """
import monarch_nb
from torch.distributed.pipelining import PipelineStage, {schedule}
pp = mesh["pp"]
stage_index, stages = pp.get_local_rank(), pp.size()
layers = mlp(layers=stages * 2)  # two layers a stage
part = layers[2 * stage_index : 2 * stage_index + 2]
stage = PipelineStage(part, stage_index, stages, device, group=pp.get_group())
schedule = {schedule}(stage, n_microbatches=4, loss_fn=F.mse_loss)
monarch_nb.label(stage=f"{{stage_index}} of {{stages}}")
opt = torch.optim.SGD(part.parameters(), lr=0.05)
x, y = data((8, 16))
losses = []
for step in range(5):
    opt.zero_grad()
    micro = []
    if stage_index == 0:
        schedule.step(x)
    elif stage_index == stages - 1:
        schedule.step(target=y, losses=micro)
    else:
        schedule.step()
    opt.step()
    losses.append(torch.stack(micro).mean().item() if micro else None)
losses
"""


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipeline_stages_equal_one_process(mesh4, schedule):
    mesh4.set_mesh("pp=4")
    mesh4.run(MODELS)
    ran = mesh4.run(PIPELINE.format(schedule=schedule))
    space: dict = {}
    exec(MODELS, space)
    expected = space["reference"](space["mlp"](layers=8), *space["data"]((8, 16)), STEPS)
    assert ran.item(3) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert ran.item(0) == [None] * STEPS  # only the last stage computes the loss
    assert mesh4.status()[2]["labels"] == {"pp": "2", "stage": "2 of 4"}


FSDP_FOREVER = """
from torch.distributed.fsdp import fully_shard
model = mlp(width=64, layers=8)
for layer in model:
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = data((64, 64))
while True:
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_an_fsdp_cell_interrupted_mid_step_leaves_the_mesh_usable(mesh2, cell, monkeypatch):
    # A rank the interrupt leaves in gloo's C code is set free by the group's timeout
    monkeypatch.setattr(dist, "DEFAULT_TIMEOUT", 5.0)
    mesh2.set_mesh("dp=2")  # formed with that timeout
    mesh2._form_group()
    try:
        mesh2.run(MODELS)
        threading.Timer(1.5, _thread.interrupt_main).start()
        cell(f"%%monarch\n{FSDP_FOREVER}", expect_error=True)
        assert isinstance(cell.error, CellError)
        assert cell.error.headline.startswith("interrupted")
        ran = mesh2.run(
            "model = mlp()\nfor layer in model:\n    fully_shard(layer, mesh=mesh['dp'])\n"
            "fully_shard(model, mesh=mesh['dp'])\n"
            f"train(model, *data((8, 16)), {STEPS}, dp=mesh['dp'])"
        )
        _same(ran, _reference("mlp", (8, 16)))
        if "formed again" in cell.err:  # the ranks had stopped at different collectives
            assert "shard them again over the new `mesh`" in cell.err
    finally:
        monkeypatch.undo()
        mesh2._form_group()
