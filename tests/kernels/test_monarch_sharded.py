# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""ShardedMonarchLinear on real gloo process groups, at 4 ranks and at 2.

One spawn of 4 ranks runs every check twice: over a 1-d mesh of 4, and over the "tp" dimension
of a (2, 2) mesh ("dp", "tp"), where ranks {0, 1} and {2, 3} are two 2-rank groups side by
side. Each rank writes what each check found to a file; the tests read them. Shapes have
k != l, in != out and k != sqrt(n) (the square case hides permutation bugs), padding, and
q = 6 rows per block, which 4 ranks do not divide (uneven all-to-all splits).
"""

from __future__ import annotations

import copy
import json
import re
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from monarch_kernels import (
    MonarchLinear,
    ShardedMonarchLinear,
    dense_tp_bytes,
    monarch_reference,
    monarch_tp_bytes,
    shard_monarch,
)
from monarch_kernels.tp_bytes import written_bytes
from torch import nn

WORLD = 4
MESHES = ("tp4", "tp2")
CHECKS = {}
# (in, out, nblocks, input layout, output layout) of MonarchLinear cases
CASES = [
    (37, 24, 4, "replicated", "replicated"),  # input padded to 40; q = 6
    (37, 24, 4, "sharded", "sharded"),
    (40, 30, 4, "replicated", "blocks"),  # output padded to 32
    (80, 96, 8, "sharded", "replicated"),
]


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


class Found(list):
    """The mismatches a check finds. It goes on after one, so that every rank runs the same
    collectives whatever it finds (a rank that stopped early would leave the others waiting)."""

    def close(self, actual, expected, what: str) -> None:
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as err:
            self.append(f"{what}: {err}")

    def true(self, ok: bool, what: str) -> None:
        if not ok:
            self.append(what)


def _layouts(full: torch.Tensor, padded: torch.Tensor, layout: str, l: int, d: int, t: int):
    """This rank's part of an output (or output-shaped) tensor in ``layout``; ``padded`` is
    the same tensor before truncation to out_features."""
    if layout == "replicated":
        return full
    if layout == "sharded":
        return full.chunk(d, -1)[t]
    blocks = padded.unflatten(-1, (-1, l))[..., t * l // d : (t + 1) * l // d]
    return blocks.flatten(-2)


def _compare(found, w1, w2, bias, in_f, out_f, layouts, group, mesh, dim, layer=None):
    """The sharded layer's output and gradients against the unsharded ones, on this rank."""
    d, t = dist.get_world_size(group), dist.get_rank(group)
    (k, _q, p), (l, s, _r) = w1.shape, w2.shape
    inl, outl = layouts
    torch.manual_seed(2)  # the same input and output gradient on every rank
    x = torch.randn(2, 3, in_f, requires_grad=True)
    g = torch.randn(2, 3, out_f)
    w1, w2, bias = (v.detach().requires_grad_() for v in (w1, w2, bias))
    if layer is None:
        y = monarch_reference(nn.functional.pad(x, (0, k * p - in_f)), w1, w2)[..., :out_f] + bias
    else:  # the MonarchLinear itself
        w1, w2, bias = layer.w1, layer.w2, layer.bias
        y = layer(x)
    (y * g).sum().backward()
    sharded = ShardedMonarchLinear(
        w1, w2, bias, mesh=mesh, dim=dim, in_features=in_f, out_features=out_f,
        input_layout=inl, output_layout=outl,
    )  # fmt: skip
    x_pad = nn.functional.pad(x.detach(), (0, k * p - in_f))
    mine = x.detach() if inl == "replicated" else x_pad.chunk(d, -1)[t]
    mine.requires_grad_()
    y_sharded = sharded(mine)
    with torch.no_grad():
        y_pad = monarch_reference(x_pad, w1, w2) + nn.functional.pad(bias, (0, s * l - out_f))
    case = f"{in_f}->{out_f} {tuple(w1.shape)} {tuple(w2.shape)} {inl} {outl}"
    found.close(y_sharded, _layouts(y.detach(), y_pad, outl, l, d, t), f"{case}: output")
    g_pad = nn.functional.pad(g, (0, s * l - out_f))
    (y_sharded * _layouts(g, g_pad, outl, l, d, t)).sum().backward()
    if inl == "replicated":
        found.close(mine.grad, x.grad, f"{case}: input gradient")
    else:  # the padding's gradient is not the unsharded layer's business
        real = torch.arange(k * p).chunk(d)[t] < in_f
        grad_x = nn.functional.pad(x.grad, (0, k * p - in_f)).chunk(d, -1)[t]
        found.close(mine.grad[..., real], grad_x[..., real], f"{case}: input gradient")
    found.close(sharded.w1.grad, w1.grad.chunk(d)[t], f"{case}: w1 gradient")
    found.close(sharded.w2.grad, w2.grad.chunk(d)[t], f"{case}: w2 gradient")
    bias_grad = nn.functional.pad(bias.grad, (0, s * l - out_f))
    found.close(sharded.bias.grad, _layouts(None, bias_grad, "blocks", l, d, t), f"{case}: bias")


@check
def outputs_and_gradients_equal_the_unsharded_layers(found, group, mesh, dim):
    for in_f, out_f, nblocks, *layouts in CASES:
        torch.manual_seed(0)
        layer = MonarchLinear(in_f, out_f, nblocks=nblocks)
        _compare(
            found, layer.w1, layer.w2, layer.bias, in_f, out_f, layouts, group, mesh, dim, layer
        )
    # factors of their own with k = 4 stage-1 blocks, l = 8 stage-2 blocks, in 18 of 20
    torch.manual_seed(1)
    w1, w2, bias = torch.randn(4, 6, 5), torch.randn(8, 7, 3), torch.randn(53)
    for layouts in (("replicated", "replicated"), ("sharded", "blocks")):
        _compare(found, w1, w2, bias, 18, 53, layouts, group, mesh, dim)


def _losses(model: nn.Module, steps: int = 4) -> list[float]:
    torch.manual_seed(3)
    x, target = torch.randn(16, 37), torch.randn(16, 40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@check
def training_steps_give_the_unsharded_losses(found, group, mesh, dim):
    torch.manual_seed(0)
    model = nn.Sequential(MonarchLinear(37, 24, nblocks=4), nn.GELU(), MonarchLinear(24, 40))
    one, two = (copy.deepcopy(model) for _ in range(2))
    expected = _losses(model)
    found.close(_losses(shard_monarch(one, mesh, dim)), expected, "shard_monarch's losses")
    # activations sharded between the layers: all-to-all instead of all-gather
    first = ShardedMonarchLinear.from_linear(two[0], mesh, dim, output_layout="sharded")
    second = ShardedMonarchLinear.from_linear(two[2], mesh, dim, input_layout="sharded")
    chain = nn.Sequential(first, nn.GELU(), second)
    found.close(_losses(chain), expected, "losses with sharded activations")


def _one_line_error(found, match: str, make) -> None:
    try:
        make()
    except ValueError as err:
        ok = re.search(match, str(err)) and "\n" not in str(err)
        found.true(ok, f"expected one line matching {match!r}, got {err}")
    else:
        found.append(f"no ValueError matching {match!r}")


@check
def mistakes_are_one_line(found, group, mesh, dim):
    d = dist.get_world_size(group)
    fits = "1, 3, 5, 15" if d == 2 else "1, 2, 3, 6"
    blocks, use = (15, "14 or 16") if d == 2 else (6, "4 or 8")
    layer = MonarchLinear(60, 60, nblocks=blocks)
    _one_line_error(
        found,
        rf"nblocks={blocks} is not divisible by the {d} ranks of the mesh dimension; use "
        rf"nblocks={use}, or a mesh dimension of size {fits}$",
        lambda: ShardedMonarchLinear.from_linear(layer, mesh, dim),
    )
    w1, w2 = torch.randn(4, 6, 5), torch.randn(6, 7, 4)  # l = 6 stage-2 blocks
    if d == 4:
        _one_line_error(found, r"l \(w2's blocks\)=6 is not", lambda: ShardedMonarchLinear(w1, w2))
    _one_line_error(
        found,
        "output_layout='sharded' needs out_features",
        lambda: ShardedMonarchLinear.from_linear(
            MonarchLinear(40, 30), mesh, dim, output_layout="sharded"
        ),
    )
    if dim is not None:
        names = r"\('dp', 'tp'\)"
        layer = MonarchLinear(40, 32)
        _one_line_error(
            found,
            rf"dim='pp' is not a dimension of the mesh, whose dimensions are {names}",
            lambda: ShardedMonarchLinear.from_linear(layer, mesh, "pp"),
        )
        _one_line_error(
            found,
            rf"the mesh has 2 dimensions {names}; name the one",
            lambda: shard_monarch(layer, mesh),
        )


def _sent(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Bytes this rank wrote during a forward and during a backward of ``module``."""
    before = written_bytes()
    y = module(x)
    middle = written_bytes()
    y.sum().backward()
    return middle - before, written_bytes() - middle


def _matches(found, measured: int, counted, d: int, what) -> None:
    """gloo sends the counted bytes plus a header of 144 bytes per message, at most 4 (d-1)
    messages per collective (an all-reduce's): less than one row of 512 float32 values."""
    extra = measured - sum(n for _, n in counted)
    ok = 0 <= extra <= 160 * 4 * (d - 1) * len(counted)
    found.true(ok, f"{what}: {measured} bytes sent, counted {counted}")


@check
def bytes_counted_are_the_bytes_sent(found, group, mesh, dim):
    d, batch = dist.get_world_size(group), 512
    torch.manual_seed(0)
    layer = MonarchLinear(200, 120, nblocks=4)
    for inl, outl in (("replicated", "replicated"), ("sharded", "sharded"), ("sharded", "blocks")):
        sharded = ShardedMonarchLinear.from_linear(
            layer, mesh, dim, input_layout=inl, output_layout=outl
        )
        x = torch.randn(batch, 200 if inl == "replicated" else sharded.local_in_features)
        x.requires_grad_()
        counted = monarch_tp_bytes(sharded, batch)
        planned = monarch_tp_bytes(
            layer, batch, d, rank=sharded.rank, input_layout=inl, output_layout=outl
        )
        found.true(counted == planned, f"{counted} counted from the layer, {planned} planned")
        forward, backward = _sent(sharded, x)
        _matches(found, forward, counted.forward, d, f"{inl}, {outl}: forward")
        _matches(found, backward, counted.backward, d, f"{inl}, {outl}: backward")
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mlp = nn.Sequential(nn.Linear(200, 96), nn.GELU(), nn.Linear(96, 120))
    parallelize_module(
        mlp, mesh[dim] if dim else mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    x = torch.randn(batch, 200, requires_grad=True)
    _sent(mlp, x)  # DTensor's first call sets itself up
    counted = dense_tp_bytes(200, 120, batch, d)
    # DTensor's all-reduces run asynchronously, the forward's into the backward: count a step
    step = sum(_sent(mlp, x))
    _matches(found, step, counted.forward + counted.backward, d, "dense forward and backward")


def _ranks(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        "tp4": (init_device_mesh("cpu", (world,)), None),
        "tp2": (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")), "tp"),
    }
    found = {}
    for name, fn in CHECKS.items():
        for label, (mesh, dim) in meshes.items():
            group = mesh.get_group(dim) if dim else mesh.get_group()
            mismatches = Found()
            try:
                fn(mismatches, group, mesh, dim)
            except Exception:
                mismatches.append(traceback.format_exc())
            found[f"{name}[{label}]"] = [f"rank {rank}: {m}" for m in mismatches]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    mp.spawn(_ranks, args=(WORLD, f"file://{tmp}/store", str(tmp)), nprocs=WORLD)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("label", MESHES)
@pytest.mark.parametrize("name", list(CHECKS))
def test_sharded(found, name, label):
    mismatches = [m for ranks in found for m in ranks[f"{name}[{label}]"]]
    assert not mismatches, "\n".join(mismatches)


def test_no_process_group_is_one_line():
    assert not dist.is_initialized()
    found = Found()
    _one_line_error(
        found,
        "no torch.distributed process group is initialised; call "
        r"torch.distributed.init_process_group\(...\)",
        lambda: ShardedMonarchLinear.from_linear(MonarchLinear(40, 32)),
    )
    assert not found, found
