# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""The compiled Triton kernels on a real GPU, against the float64 reference.

Skipped where there is no GPU (CI). On a GPU machine:

    PYTHONPATH=kernels:tests python -m pytest -p no:cacheprovider tests/kernels/test_monarch_gpu.py

Each check draws fresh random inputs, fills the allocator's cached blocks with NaN first (so
an element a kernel never wrote cannot pass), and compares by relative Frobenius error.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from monarch_kernels import (  # noqa: E402
    MonarchLinear,
    monarch_matmul,
    monarch_reference,
    triton_launch,
)
from monarch_kernels.configs import get_configs  # noqa: E402

DEV = torch.device("cuda")
# relative Frobenius error allowed: fp32 dots run in IEEE fp32; bf16/fp16 round the inputs,
# the intermediate and the output
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (B, k, p, q, l, s): square many-block, k != l with in != out, wide blocks, odd sizes
SHAPES = [
    (1000, 64, 64, 64, 64, 64),
    (777, 8, 96, 80, 10, 50),
    (300, 4, 256, 256, 4, 300),
    (37, 4, 6, 5, 5, 3),
]


def _poison() -> None:
    """Leave NaN in the caching allocator's free blocks, where the next outputs will land."""
    free = torch.cuda.mem_get_info()[0]
    junk = torch.empty(min(free // 4, 2**30) // 4, device=DEV).fill_(float("nan"))
    del junk


def _inputs(shape, dtype, seed, strided=False):
    B, k, p, q, l, s = shape
    r = k * q // l
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g, device=DEV, dtype=torch.float64)

    if strided:
        x = randn(k * p, 2 * B).t()[::2]
        w1 = randn(k, p, q).transpose(1, 2) / p**0.5
        w2 = randn(s, l, r).transpose(0, 1) / r**0.5
    else:
        x, w1, w2 = randn(B, k * p), randn(k, q, p) / p**0.5, randn(l, s, r) / r**0.5
    dy = randn(B, s * l)
    return x, w1, w2, dy


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all(), "non-finite output (an element never written?)"
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _grads64(x, w1, w2, dy):
    a = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    monarch_reference(*a).backward(dy)
    return [t.grad for t in a]


def _cast(tensors, dtype):
    # keep strides: the kernels must read non-contiguous inputs in place
    return [t.to(dtype) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", triton_launch.PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_reference(shape, path, dtype):
    for seed, strided in ((0, False), (1, True)):
        x, w1, w2, dy = _inputs(shape, torch.float64, seed, strided)
        want = monarch_reference(x, w1, w2)
        grads = _grads64(x, w1, w2, dy)
        xs, w1s, w2s, dys = _cast((x, w1, w2, dy), dtype)
        first = {kind: get_configs(kind)[0] for kind in triton_launch._KERNELS}
        _poison()
        y = triton_launch.monarch_forward(xs, w1s, w2s, path=path, configs=first)
        assert _rel(y, want) < TOL[dtype], ("y", _rel(y, want))
        _poison()
        got = triton_launch.monarch_backward(dys, xs, w1s, w2s, path=path, configs=first)
        for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
            assert _rel(a, b) < TOL[dtype], (name, _rel(a, b))


@pytest.mark.parametrize("kind", ["stage", "wgrad"])
def test_every_config_of_the_active_backend(kind):
    """bfloat16, the square many-block case and an odd one, every config of ``kind``."""
    for shape in SHAPES[:2]:
        x, w1, w2, dy = _inputs(shape, torch.float64, 5)
        want = monarch_reference(x, w1, w2)
        grads = _grads64(x, w1, w2, dy)
        xs, w1s, w2s, dys = _cast((x, w1, w2, dy), torch.bfloat16)
        for cfg in get_configs(kind):
            _poison()
            c = {kind: cfg}
            y = triton_launch.monarch_forward(xs, w1s, w2s, path="three_kernel", configs=c)
            assert _rel(y, want) < 2e-2, (cfg, _rel(y, want))
            got = triton_launch.monarch_backward(dys, xs, w1s, w2s, path="three_kernel", configs=c)
            for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                assert _rel(a, b) < 2e-2, (cfg, name, _rel(a, b))


@pytest.mark.parametrize("path", triton_launch.PATHS)
def test_weight_gradients_are_deterministic(path):
    x, w1, w2, dy = _cast(_inputs(SHAPES[0], torch.float64, 3), torch.bfloat16)
    first = triton_launch.monarch_backward(dy, x, w1, w2, path=path)
    for _ in range(3):
        again = triton_launch.monarch_backward(dy, x, w1, w2, path=path)
        # dw1 and dw2 (dx comes from vendor GEMMs on the blas path, which may use atomics)
        for a, b in zip(first[1:], again[1:], strict=True):
            assert torch.equal(a, b)


def test_path_is_chosen_once_per_batch_bucket(monkeypatch):
    """Batch sizes in one power-of-two bucket share the timed path choice; the next bucket
    is timed anew."""
    monkeypatch.setattr(triton_launch, "_path_choice", {})
    w1, w2 = _cast(_inputs(SHAPES[0], torch.float64, 8)[1:3], torch.bfloat16)
    for rows in (1000, 600, 1024, 1025):
        x = torch.randn(rows, w1.shape[0] * w1.shape[2], device=DEV, dtype=torch.bfloat16)
        y = monarch_matmul(x, w1, w2)
        assert _rel(y, monarch_reference(x.double(), w1.double(), w2.double())) < 2e-2
    assert sorted(key[1] for key in triton_launch._path_choice) == [1024, 2048]


def test_op_autotuned_with_batch_dims_and_autograd():
    x, w1, w2, dy = _inputs(SHAPES[1], torch.float64, 4)
    B = x.shape[0]
    want = monarch_reference(x, w1, w2)
    grads = _grads64(x, w1, w2, dy)
    a = [t.to(torch.bfloat16).requires_grad_() for t in (x, w1, w2)]
    y = monarch_matmul(a[0].view(7, B // 7, -1), a[1], a[2])
    assert y.shape == (7, B // 7, want.shape[1])
    assert _rel(y.reshape(B, -1), want) < 2e-2
    y.backward(dy.to(torch.bfloat16).view(y.shape))
    for name, t, g in zip(("dx", "dw1", "dw2"), a, grads, strict=True):
        assert _rel(t.grad.reshape(g.shape), g) < 2e-2, name


def test_eager_route_matches_the_custom_ops_and_replays_in_a_cuda_graph():
    """Eager calls (a plain autograd.Function) and the custom ops that compiled code calls
    compute the same; a training step of the op captured as a CUDA graph replays correctly
    on new inputs (the path and configs were chosen before the capture)."""
    x, w1, w2, dy = _cast(_inputs(SHAPES[0], torch.float64, 5), torch.bfloat16)

    def step(leaves, keep_op=False):
        for t in leaves:
            t.grad = None
        if keep_op:
            y = torch.ops.monarch_kernels.monarch_matmul_keep(*leaves)[0]
        else:
            y = monarch_matmul(*leaves)
        y.backward(dy)
        return y

    eager = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ops = [t.clone().requires_grad_() for t in (x, w1, w2)]
    y_eager, y_ops = step(eager), step(ops, keep_op=True)
    torch.testing.assert_close(y_eager, y_ops, rtol=1e-2, atol=1e-2)
    for a, b in zip(eager, ops, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-2)

    static = [t.clone().requires_grad_() for t in (x, w1, w2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step(static)
    for seed in (6, 7):
        fresh = _cast(_inputs(SHAPES[0], torch.float64, seed), torch.bfloat16)[:3]
        with torch.no_grad():
            for t, v in zip(static, fresh, strict=True):
                t.copy_(v)
        graph.replay()
        want = [t.clone().requires_grad_() for t in fresh]
        torch.testing.assert_close(y_static, step(want), rtol=1e-2, atol=1e-2)
        for a, b in zip(static, want, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-2)


def test_monarch_linear_compiles_fullgraph_and_learns():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        MonarchLinear(256, 512, nblocks=8, device=DEV, dtype=torch.bfloat16),
        torch.nn.GELU(),
        torch.nn.Linear(512, 1, device=DEV, dtype=torch.bfloat16),  # one output: no blocks
    )
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16)
    target = x[:, :8].float().sum(1, keepdim=True).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(compiled(x).float(), target.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
