# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Run the Triton kernels under the interpreter and compare them with the reference.

Imported by nothing in the main test process: ``test_monarch_triton.py`` runs this file as a
script in a subprocess with ``TRITON_INTERPRET=1``, because Triton reads that variable when
kernels are decorated, once per process.

    TRITON_INTERPRET=1 python tests/_kernel_helpers.py cuda forward,backward
"""

from __future__ import annotations

import os
import sys

# (B, k, p, q, l, s): k != l, in != out, k != sqrt(n), odd sizes that no block divides
SHAPES = [(37, 4, 6, 5, 5, 3), (19, 2, 8, 12, 3, 5), (21, 8, 4, 6, 16, 3), (13, 5, 3, 4, 10, 3)]
CONFIG_SETS = ("cuda", "hip-gfx942", "hip-gfx950")


def _configs(name: str, kind: str):
    from monarch_kernels.configs import _cuda_configs, _hip_configs

    if name == "cuda":
        return _cuda_configs(kind)
    return _hip_configs(kind, arch=name.split("-", 1)[1])


def _tiles(cfg) -> tuple[int, int, int]:
    return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_O"], cfg.kwargs["BLOCK_C"]


def _interpreted_configs(name: str, kind: str) -> list:
    """The configs of set ``name`` whose run under the interpreter no earlier set's covers.

    The interpreter runs a kernel with its tile sizes only (warps, stages and AMD's options
    change the compiled code, which the AOT tests check): a config with the tiles of one in an
    earlier set of CONFIG_SETS computes the same, and is skipped. A set's first config always
    runs, so that every backend's launch, with its own options, is exercised."""
    earlier = {
        _tiles(cfg)
        for other in CONFIG_SETS[: CONFIG_SETS.index(name)]
        for cfg in _configs(other, kind)
    }
    cfgs = _configs(name, kind)
    return [cfg for i, cfg in enumerate(cfgs) if i == 0 or _tiles(cfg) not in earlier]


def _backend_default_checked_earlier(name: str) -> bool:
    """Whether an earlier set already ran the launches that take the backend's default configs
    (``MONARCH_KERNELS_CONFIGS`` names a backend, not an architecture: gfx950's are gfx942's)."""
    backend = name.split("-", 1)[0]
    return any(o.split("-", 1)[0] == backend for o in CONFIG_SETS[: CONFIG_SETS.index(name)])


def _inputs(shape, seed: int, strided: bool):
    import torch

    B, k, p, q, l, s = shape
    r = k * q // l
    g = torch.Generator().manual_seed(seed)
    if strided:  # non-contiguous activations and weights, read through their strides
        x = torch.randn(k * p, 2 * B, generator=g).t()[::2]
        w1 = torch.randn(k, p, q, generator=g).transpose(1, 2)
        w2 = torch.randn(s, l, r, generator=g).transpose(0, 1)
    else:
        x = torch.randn(B, k * p, generator=g)
        w1 = torch.randn(k, q, p, generator=g)
        w2 = torch.randn(l, s, r, generator=g)
    return x, w1, w2


def _close(name: str, got, want, context: str) -> None:
    import torch

    err = (got - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    if not torch.isfinite(got).all() or err > 1e-5 * scale:
        raise AssertionError(f"{context}: {name} max error {err:.3g} (scale {scale:.3g})")


def check(config_set: str, direction: str) -> int:
    """Every config of ``config_set`` that no earlier set covers (``_interpreted_configs``) on
    every shape, and the paths that take the backend's default configs; returns the number of
    checks."""
    import torch
    from monarch_kernels import triton_launch
    from monarch_kernels.ops import _torch_backward
    from monarch_kernels.reference import monarch_reference
    from monarch_kernels.triton_launch import monarch_backward, monarch_forward

    defaults = not _backend_default_checked_earlier(config_set)
    count = 0
    for i, shape in enumerate(SHAPES):
        x, w1, w2 = _inputs(shape, seed=i, strided=i % 2 == 1)
        want = monarch_reference(x, w1, w2)
        dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(100 + i))
        grads = _torch_backward(dy, x, w1, w2)
        kinds = ("stage", "wgrad") if direction == "backward" else ("stage",)
        for kind in kinds:
            for cfg in _interpreted_configs(config_set, kind):
                ctx = f"{config_set} {direction} {kind} {cfg} shape {shape}"
                if direction == "forward":
                    got = monarch_forward(x, w1, w2, path="three_kernel", configs={kind: cfg})
                    _close("y", got, want, ctx)
                else:
                    got = monarch_backward(
                        dy, x, w1, w2, path="three_kernel", configs={kind: cfg}, splits=2
                    )
                    for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                        _close(name, a, b, ctx)
                count += 1
        if not defaults:
            continue
        # the BLAS path: torch.bmm for the block products, the batch-last Triton pass for the
        # output permutation, the wgrad kernel or torch.bmm (backward), with and without a kept
        # intermediate
        ctx = f"{config_set} {direction} blas shape {shape}"
        y, h = monarch_forward(x, w1, w2, path="blas", keep=True)
        _close("y", y, want, ctx)
        _close("h", h, monarch_forward(x, w1, w2, path="three_kernel", keep=True)[1], ctx)
        if direction == "backward":
            vendor = triton_launch.vendor_weight_grads
            for kept in (h, None):
                for on_vendor in (False, True):  # the weight gradients on torch.bmm, as on CUDA
                    triton_launch.vendor_weight_grads = lambda device, v=on_vendor: v
                    try:
                        got = monarch_backward(dy, x, w1, w2, path="blas", h=kept, splits=2)
                    finally:
                        triton_launch.vendor_weight_grads = vendor
                    for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                        _close(name, a, b, f"{ctx} kept={kept is not None} vendor={on_vendor}")
            # the three-kernel backward with the forward's intermediate kept
            got = monarch_backward(dy, x, w1, w2, path="three_kernel", h=h, splits=2)
            for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                _close(name, a, b, f"{config_set} three_kernel kept shape {shape}")
        count += 1
    if direction == "backward" and defaults:
        count += _check_splits()
    return count


def _check_splits() -> int:
    """Weight-gradient splits on 64-row boundaries: 150 rows in 3 splits (64, 64, 22 rows)
    and in 4 (the last one without rows), on both paths."""
    import torch
    from monarch_kernels.ops import _torch_backward
    from monarch_kernels.reference import monarch_reference
    from monarch_kernels.triton_launch import PATHS, monarch_backward, monarch_forward

    count = 0
    for i, (_B, k, p, q, l, s) in enumerate(SHAPES[:2]):
        x, w1, w2 = _inputs((150, k, p, q, l, s), seed=50 + i, strided=False)
        want = monarch_reference(x, w1, w2)
        dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(60 + i))
        grads = _torch_backward(dy, x, w1, w2)
        for path in PATHS:
            ctx = f"splits path={path} shape {(150, k, p, q, l, s)}"
            _close("y", monarch_forward(x, w1, w2, path=path), want, ctx)
            for splits in (3, 4):
                got = monarch_backward(dy, x, w1, w2, path=path, splits=splits)
                for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                    _close(name, a, b, f"{ctx} splits={splits}")
            count += 1
    return count


def check_op() -> int:
    """The custom op and its autograd routed to the kernels (any batch dims, strided input)."""
    import torch
    from monarch_kernels import monarch_matmul, monarch_reference, ops, triton_launch

    launches = []
    for name in ("monarch_forward", "monarch_backward"):
        fn = getattr(triton_launch, name)
        setattr(
            triton_launch,
            name,
            lambda *a, _fn=fn, _n=name, **k: launches.append(_n) or _fn(*a, **k),
        )
    ops._use_triton = lambda device: True  # the interpreter runs the kernels on CPU tensors
    count = 0
    for path in triton_launch.PATHS:
        os.environ[triton_launch.PATH_ENV_VAR] = path
        for i, shape in enumerate(SHAPES):
            B, k, p, _q, l, s = shape
            x, w1, w2 = _inputs(shape, seed=i, strided=True)
            x = x.reshape(1, B, k * p).expand(2, B, k * p)  # an expanded leading batch dimension
            dy = torch.randn(2, B, s * l, generator=torch.Generator().manual_seed(7))
            a = [t.detach().requires_grad_() for t in (x, w1, w2)]
            b = [t.detach().requires_grad_() for t in (x, w1, w2)]
            got = monarch_matmul(*a)
            want = monarch_reference(*b)
            ctx = f"op path={path} shape {shape}"
            _close("y", got, want, ctx)
            got.backward(dy)
            want.backward(dy)
            for name, ga, gb in zip(("dx", "dw1", "dw2"), a, b, strict=True):
                _close(name, ga.grad, gb.grad, ctx)
            count += 1
    if launches.count("monarch_forward") != count or launches.count("monarch_backward") != count:
        raise AssertionError(f"the op did not route to the Triton launchers: {launches}")
    return count


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    # one process for several directions: Triton's and torch's imports are paid once
    for direction in sys.argv[2].split(","):
        n = check_op() if direction == "op" else check(sys.argv[1], direction)
        print(f"{direction}: {n} checks passed")
