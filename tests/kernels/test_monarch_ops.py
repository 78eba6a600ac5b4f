# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The custom op on CPU: agreement with the reference, gradients, compile, bad input."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from monarch_kernels import monarch_matmul, monarch_reference, ops
from torch.utils._python_dispatch import TorchDispatchMode


@st.composite
def monarch_case(draw):
    k = draw(st.integers(1, 5))
    p = draw(st.integers(1, 6))
    q = draw(st.integers(1, 6))
    # l must divide k*q; r follows
    divisors = [d for d in range(1, k * q + 1) if (k * q) % d == 0]
    l = draw(st.sampled_from(divisors))
    s = draw(st.integers(1, 6))
    batch = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "weights_strided"]))
    return k, p, q, l, s, tuple(batch), layout


def make(case, dtype=torch.float64, seed=0):
    k, p, q, l, s, batch, layout = case
    r = k * q // l
    n = k * p
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, generator=g, dtype=dtype)
    w1 = torch.randn(k, q, p, generator=g, dtype=dtype)
    w2 = torch.randn(l, s, r, generator=g, dtype=dtype)
    if layout == "transposed":  # feature dimension not innermost
        x = torch.randn(n, *batch, generator=g, dtype=dtype).movedim(0, -1)
    elif layout == "sliced":
        x = torch.randn(*batch, 2 * n, generator=g, dtype=dtype)[..., ::2]
    elif layout == "weights_strided":
        w1 = torch.randn(p, k, q, generator=g, dtype=dtype).permute(1, 2, 0)
        w2 = torch.randn(r, s, l, generator=g, dtype=dtype).permute(2, 1, 0)
    return x, w1, w2


@settings(max_examples=60, deadline=None)
@given(monarch_case())
def test_op_matches_reference_fp64(case):
    x, w1, w2 = make(case)
    y = monarch_matmul(x, w1, w2)
    torch.testing.assert_close(y, monarch_reference(x, w1, w2), rtol=1e-12, atol=1e-12)
    assert y.shape == (*x.shape[:-1], w2.shape[0] * w2.shape[1])
    assert y.is_contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_op_matches_reference_low_precision(dtype, tol):
    x, w1, w2 = make((8, 16, 16, 4, 8, (3, 33), "contiguous"), dtype=dtype)
    want = monarch_reference(x.double(), w1.double(), w2.double())
    got = monarch_matmul(x, w1, w2).double()
    assert ((got - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize(
    "case",
    [
        (4, 3, 5, 5, 2, (7,), "contiguous"),
        (2, 4, 6, 3, 5, (2, 3), "transposed"),
        (3, 2, 4, 6, 3, (5,), "weights_strided"),
    ],
)
def test_gradcheck_fp64(case):
    x, w1, w2 = make(case)
    inputs = tuple(t.detach().requires_grad_() for t in (x, w1, w2))
    assert torch.autograd.gradcheck(monarch_matmul, inputs)


def test_gradients_match_reference_autograd():
    x, w1, w2 = make((4, 6, 5, 5, 3, (9,), "sliced"))
    a = [t.detach().requires_grad_() for t in (x, w1, w2)]
    b = [t.detach().requires_grad_() for t in (x, w1, w2)]
    dy = torch.randn(9, 15, dtype=torch.float64)
    monarch_matmul(*a).backward(dy)
    monarch_reference(*b).backward(dy)
    for ga, gb in zip(a, b, strict=True):
        torch.testing.assert_close(ga.grad, gb.grad)


def test_opcheck_registration():
    x, w1, w2 = make((4, 6, 5, 5, 3, (9,), "contiguous"), dtype=torch.float32)
    for t in (x, w1, w2):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.monarch_kernels.monarch_matmul.default, (x, w1, w2))
    xs, w1s, w2s = make((4, 6, 5, 5, 3, (3, 4), "transposed"), dtype=torch.float32)
    torch.library.opcheck(torch.ops.monarch_kernels.monarch_matmul.default, (xs, w1s, w2s))
    dy = torch.randn(3, 4, 15)
    torch.library.opcheck(
        torch.ops.monarch_kernels.monarch_matmul_backward.default, (dy, xs, w1s, w2s)
    )
    # the training forward, which keeps the intermediate, and the backward that takes it
    torch.library.opcheck(torch.ops.monarch_kernels.monarch_matmul_keep.default, (x, w1, w2))
    _y, h = torch.ops.monarch_kernels.monarch_matmul_keep(xs, w1s, w2s)
    torch.library.opcheck(
        torch.ops.monarch_kernels.monarch_matmul_backward.default, (dy, xs, w1s, w2s, h)
    )


def test_kept_intermediate_gives_the_recomputed_gradients():
    x, w1, w2 = make((4, 6, 5, 10, 3, (7,), "transposed"), seed=3)
    dy = torch.randn(7, 30, dtype=torch.float64)
    _y, h = torch.ops.monarch_kernels.monarch_matmul_keep(x, w1, w2)
    kept = torch.ops.monarch_kernels.monarch_matmul_backward(dy, x, w1, w2, h)
    again = torch.ops.monarch_kernels.monarch_matmul_backward(dy, x, w1, w2)
    for a, b in zip(kept, again, strict=True):
        torch.testing.assert_close(a, b)
    # with grad enabled the public function keeps the intermediate; without, no graph
    assert x.requires_grad is False
    w1.requires_grad_()
    y = monarch_matmul(x, w1, w2)
    assert "MonarchMatmul" in type(y.grad_fn).__name__
    with torch.no_grad():
        assert monarch_matmul(x, w1, w2).grad_fn is None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_route_matches_the_custom_ops_and_modes_see_the_ops():
    """Eager calls take the plain autograd.Function; under a dispatch mode (fake tensors,
    export) the custom ops run, and both give the same values and gradients."""
    x, w1, w2 = make((4, 6, 5, 10, 3, (7,), "transposed"), seed=4)
    dy = torch.randn(7, 30, dtype=torch.float64)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
    y = monarch_matmul(*leaves)
    y.backward(dy)
    assert type(y.grad_fn).__name__ == "_MonarchMatmulBackward"
    again = [t.detach().requires_grad_() for t in (x, w1, w2)]
    with _Recorder() as rec:
        y_op = monarch_matmul(*again)
        y_op.backward(dy)
    assert "monarch_kernels.monarch_matmul_keep.default" in rec.ops
    assert "monarch_kernels.monarch_matmul_backward.default" in rec.ops
    torch.testing.assert_close(y, y_op, rtol=0, atol=0)
    for a, b in zip(leaves, again, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with _Recorder() as rec, torch.no_grad():
        monarch_matmul(x, w1, w2)
    assert rec.ops[0] == "monarch_kernels.monarch_matmul.default"


def test_compile_sees_one_opaque_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, w1, w2 = make((4, 6, 5, 5, 3, (9,), "contiguous"), dtype=torch.float32)
    fn = torch.compile(
        lambda x: torch.relu(monarch_matmul(x, w1, w2)) * 2, backend=backend, fullgraph=True
    )
    torch.testing.assert_close(fn(x), torch.relu(monarch_reference(x, w1, w2)) * 2)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.monarch_kernels.monarch_matmul
    assert sum(t in (op, op.default) for t in targets) == 1
    assert not any("bmm" in str(t) for t in targets)


def test_bad_input_is_one_clear_line():
    x, w1, w2 = make((4, 6, 5, 5, 3, (9,), "contiguous"), dtype=torch.float32)
    cases = [
        ((x[:, :23], w1, w2), ValueError, r"expected x \(\.\.\., 24\)"),
        ((x, w1, w2[:, :, :3]), ValueError, r"l \* r == k \* q == 20"),
        ((x.long(), w1.long(), w2.long()), TypeError, "expected a floating dtype"),
        ((x, w1.double(), w2), TypeError, "mixed dtypes"),
        ((x, w1.to("meta"), w2), ValueError, "different devices"),
        ((x, w1[0], w2), ValueError, "3-d"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match) as info:
            monarch_matmul(*args)
        assert "\n" not in str(info.value)


def test_empty_batch():
    x, w1, w2 = make((4, 6, 5, 5, 3, (0, 2), "contiguous"))
    x.requires_grad_()
    y = monarch_matmul(x, w1, w2)
    assert y.shape == (0, 2, 15)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_missing_triton_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(ops, "_triton_state", {})
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.warns(RuntimeWarning, match="Triton is not usable.*Error.*torch path"):
        assert ops._use_triton(torch.device("cuda")) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops._use_triton(torch.device("cuda")) is False
    assert ops._use_triton(torch.device("cpu")) is False


def test_double_backward_matches_the_reference():
    """create_graph=True (a gradient penalty): the eager route's backward is differentiable
    again, and where it is not asked to be, the kernels' backward runs as before."""
    x, w1, w2 = make((4, 6, 5, 2, 7, (3,), "transposed"))
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
    assert torch.autograd.gradgradcheck(monarch_matmul, leaves)

    def penalty(product):
        (gx,) = torch.autograd.grad(product(*leaves).square().sum(), leaves[0], create_graph=True)
        return torch.autograd.grad(gx.square().sum(), leaves[1:])

    for a, b in zip(penalty(monarch_matmul), penalty(monarch_reference), strict=True):
        torch.testing.assert_close(a, b)


def test_functorch_transforms_match_the_reference():
    """jvp, jacfwd, grad, vmap and per-sample gradients: the custom ops' autograd is
    backward-only, so under a transform the product is made of plain torch ops (a missing
    forward-mode rule would give a zero tangent without an error)."""
    from monarch_kernels import MonarchLinear
    from torch.func import functional_call, grad, jacfwd, jvp, vmap

    x, w1, w2 = make((4, 6, 5, 2, 7, (3, 5), "transposed"))
    tx = torch.randn_like(x)

    def ours(a):
        return monarch_matmul(a, w1, w2)

    def ref(a):
        return monarch_reference(a, w1, w2)

    for transform in (
        lambda f: jvp(f, (x,), (tx,))[1],
        lambda f: jacfwd(f)(x[0, 0]),
        lambda f: grad(lambda a: f(a).square().sum())(x),
        lambda f: vmap(f)(x),
    ):
        torch.testing.assert_close(transform(ours), transform(ref))
    layer = MonarchLinear(24, 14, nblocks=2, dtype=torch.float64)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p, row):
        return functional_call(layer, p, (row,)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x[0])
    for i, row in enumerate(x[0]):
        layer.zero_grad()
        layer(row).square().sum().backward()
        torch.testing.assert_close(per_sample["w1"][i], layer.w1.grad)


@pytest.mark.parametrize(
    ("version", "match"),
    [
        ("2.1.0", "older than 3.0"),
        ("main", "Triton is not usable.*ValueError.*torch path"),  # a source build's: no crash
    ],
)
def test_old_or_unusable_triton_warns_and_falls_back(monkeypatch, version, match):
    monkeypatch.setattr(ops, "_triton_state", {})
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    with pytest.warns(RuntimeWarning, match=match):
        assert ops._use_triton(torch.device("cuda:0")) is False


def test_cpu_never_warns_about_triton():
    x, w1, w2 = make((4, 6, 5, 5, 3, (9,), "contiguous"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monarch_matmul(x, w1, w2)
