"""MonarchLinear as a drop-in for nn.Linear."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from monarch_kernels import MonarchLinear, monarch_reference
from torch import nn


@pytest.mark.parametrize("in_f,out_f,nblocks", [(10, 7, 4), (24, 40, 4), (33, 33, 3), (3, 5, 4)])
def test_any_sizes_match_dense_weight(in_f, out_f, nblocks):
    with warnings.catch_warnings(record=True) as caught:  # (3, 5, 4) and (10, 7, 4) warn
        warnings.simplefilter("always")
        layer = MonarchLinear(in_f, out_f, nblocks=nblocks, dtype=torch.float64)
    reached = bool((layer.dense_weight() != 0).all())
    assert bool(caught) != reached, [str(w.message) for w in caught]
    x = torch.randn(2, 5, in_f, dtype=torch.float64)
    y = layer(x)
    assert y.shape == (2, 5, out_f)
    torch.testing.assert_close(y, x @ layer.dense_weight().T + layer.bias)
    padded = nn.functional.pad(x, (0, layer.in_features_padded - in_f))
    torch.testing.assert_close(
        y - layer.bias, monarch_reference(padded, layer.w1, layer.w2)[..., :out_f]
    )


def test_interface_like_linear():
    layer = MonarchLinear(24, 40, nblocks=4, bias=False, dtype=torch.float64)
    assert layer.bias is None and set(layer.state_dict()) == {"w1", "w2"}
    assert layer.w1.dtype == torch.float64 and layer.w1.device.type == "cpu"
    assert layer.w1.shape == (4, 6, 6) and layer.w2.shape == (4, 10, 6)
    meta = MonarchLinear(24, 40, device="meta")
    assert meta.w1.is_meta and meta.bias.is_meta
    assert "weight params=384 vs dense 960" in repr(layer)
    with pytest.raises(ValueError, match=r"expected input \(\.\.\., 24\)"):
        layer(torch.randn(3, 23, dtype=torch.float64))
    with pytest.raises(ValueError, match="nblocks=0"):
        MonarchLinear(4, 4, nblocks=0)
    with pytest.raises(TypeError, match=r"nblocks must be an int, got 2\.0"):
        MonarchLinear(10, 20, nblocks=2.0)


def test_too_many_blocks_warn_and_say_how_many_connect():
    """With blocks of q < nblocks, output blocks reach only q of the input blocks: some
    outputs never see some inputs, which no user of nn.Linear expects silently."""
    with pytest.warns(UserWarning, match=r"nblocks=8\): blocks of 1 < 8.*nblocks=2 connects"):
        layer = MonarchLinear(3, 5, nblocks=8)
    assert (layer.dense_weight() == 0).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (MonarchLinear(3, 5, nblocks=2).dense_weight() != 0).all()
        MonarchLinear(4096, 4096, nblocks=64)  # q = 64: every block reached


def test_output_can_be_modified_in_place_as_linears_can():
    torch.manual_seed(0)
    for layer in (MonarchLinear(64, 64, bias=False), MonarchLinear(64, 60, bias=False)):
        x = torch.randn(2, 3, 64, requires_grad=True)
        nn.Sequential(layer, nn.ReLU(inplace=True))(x).sum().backward()
        dense = x.detach().clone().requires_grad_()
        torch.relu(dense @ layer.dense_weight().detach().T).sum().backward()
        torch.testing.assert_close(x.grad, dense.grad)


def test_autocast_computes_in_its_dtype_as_linear_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), MonarchLinear(32, 32))
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        dense = nn.Linear(32, 32)(model[0](x))
    assert y.dtype == dense.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), model(x), rtol=3e-2, atol=3e-2)
    y.float().sum().backward()
    assert model[1].w1.grad.dtype == torch.float32
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(x).dtype == torch.bfloat16


def test_state_dict_round_trip():
    a = MonarchLinear(30, 18, nblocks=3)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = MonarchLinear(30, 18, nblocks=3)
    b.load_state_dict(torch.load(buf))
    x = torch.randn(4, 30)
    torch.testing.assert_close(a(x), b(x))
    with pytest.raises(RuntimeError, match="size mismatch"):
        MonarchLinear(30, 18, nblocks=2).load_state_dict(a.state_dict())


def test_init_matches_linear_output_variance():
    torch.manual_seed(0)
    x = torch.randn(4096, 512)
    ratios = []
    for _ in range(3):
        dense = nn.Linear(512, 384, bias=False)
        mon = MonarchLinear(512, 384, nblocks=4, bias=False)
        ratios.append((mon(x).var() / dense(x).var()).item())
    assert 0.85 < sum(ratios) / len(ratios) < 1.15, ratios


def test_from_linear_exact_on_monarch_weight():
    src = MonarchLinear(24, 40, nblocks=4, dtype=torch.float64)
    dense = nn.Linear(24, 40, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(src.dense_weight())
    layer = MonarchLinear.from_linear(dense, nblocks=4)
    x = torch.randn(7, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense(x))


def test_from_linear_any_size_reduces_error():
    dense = nn.Linear(10, 7)
    layer = MonarchLinear.from_linear(dense, nblocks=3)  # neither size a multiple of 3
    err = (layer.dense_weight() - dense.weight).norm()
    assert err < dense.weight.norm()
    torch.testing.assert_close(layer.bias, dense.bias)


def test_loss_falls_on_regression():
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    target = x @ torch.randn(32, 20) / 32**0.5
    model = MonarchLinear(32, 20, nblocks=4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


def test_compile_fullgraph_inductor_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(MonarchLinear(20, 30, 4), nn.GELU(), MonarchLinear(30, 7, 2))
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 20)
    y = compiled(x)
    torch.testing.assert_close(y, model(x))
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
