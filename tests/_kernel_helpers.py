# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""Run the Triton kernels under the interpreter and compare them with the reference.

Imported by nothing in the main test process: ``test_monarch_triton.py`` runs this file as a
script in a subprocess with ``TRITON_INTERPRET=1``, because Triton reads that variable when
kernels are decorated, once per process.

    TRITON_INTERPRET=1 python tests/_kernel_helpers.py cuda forward
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
    """Every config of ``config_set`` on every shape and path; returns the number of checks."""
    import torch
    from monarch_kernels import backward_launch, triton_launch
    from monarch_kernels.backward_launch import monarch_backward
    from monarch_kernels.forward_launch import monarch_forward
    from monarch_kernels.ops import _torch_backward
    from monarch_kernels.reference import monarch_reference

    count = 0
    for i, shape in enumerate(SHAPES):
        x, w1, w2 = _inputs(shape, seed=i, strided=i % 2 == 1)
        want = monarch_reference(x, w1, w2)
        dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(100 + i))
        grads = _torch_backward(dy, x, w1, w2)
        kinds = ("fused", "stage", "group")
        kinds += ("wgrad", "stage_wgrad") if direction == "backward" else ("pipeline",)
        for kind in kinds:
            for cfg in _configs(config_set, kind):
                path = triton_launch.KIND_PATHS[kind]
                # the one-block kernel everywhere, or grouped where the output interleaves
                triton_launch.GROUPED = kind != "stage"
                ctx = f"{config_set} {direction} {kind} {cfg} shape {shape}"
                if direction == "forward":
                    got = monarch_forward(x, w1, w2, path=path, configs={kind: cfg}, num_programs=2)
                    _close("y", got, want, ctx)
                else:
                    got = monarch_backward(
                        dy, x, w1, w2, path=path, configs={kind: cfg}, num_programs=2, splits=2
                    )
                    for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                        _close(name, a, b, ctx)
                count += 1
        # the BLAS path: torch.bmm for the block products, the batch-last Triton pass for the
        # output permutation, the wgrad kernel or torch.bmm (backward), with and without a kept
        # intermediate
        ctx = f"{config_set} {direction} blas shape {shape}"
        y, h = monarch_forward(x, w1, w2, path="blas", keep=True)
        _close("y", y, want, ctx)
        _close("h", h, monarch_forward(x, w1, w2, path="two_kernel", keep=True)[1], ctx)
        if direction == "backward":
            for kept in (h, None):
                got = monarch_backward(dy, x, w1, w2, path="blas", h=kept, splits=2)
                for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                    _close(name, a, b, f"{ctx} kept={kept is not None}")
                # the weight gradients on the vendor GEMM too, as on CUDA
                got = backward_launch._blas_backward(dy, x, w1, w2, kept, 2, None, True)
                for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                    _close(name, a, b, f"{ctx} kept={kept is not None} vendor weight gradients")
        count += 1
        # the chunked path in chunks of 16 rows, the last one partial; each chunk's weight
        # gradients in 2 splits; with the intermediate kept, not kept, and recomputed
        ctx = f"{config_set} {direction} chunked shape {shape}"
        y, hc = monarch_forward(x, w1, w2, path="chunked", keep=True, chunk_rows=16)
        _close("y", y, want, ctx)
        _close("h", hc, h, ctx)
        _close("y", monarch_forward(x, w1, w2, path="chunked", chunk_rows=16), want, ctx)
        if direction == "backward":
            for kept in (hc, None):
                got = monarch_backward(
                    dy, x, w1, w2, path="chunked", h=kept, chunk_rows=16, splits=2
                )
                for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                    _close(name, a, b, f"{ctx} kept={kept is not None}")
        count += 1
    if direction == "backward":
        count += _check_splits(config_set)
    return count


def _check_splits(config_set: str) -> int:
    """Weight gradients reduced over several row splits (each starts on a 64-row boundary,
    so the shapes above fit in one): 150 rows in 3 splits, the last one partial, on every
    path that splits. The second shape's block counts and widths are powers of two, which the
    shapes above avoid."""
    import torch
    from monarch_kernels.backward_launch import monarch_backward
    from monarch_kernels.forward_launch import monarch_forward
    from monarch_kernels.ops import _torch_backward
    from monarch_kernels.reference import monarch_reference

    count = 0
    for shape in ((150, 4, 8, 6, 3, 5), (150, 4, 8, 6, 2, 8)):
        B, _k, _p, _q, l, s = shape
        x, w1, w2 = _inputs(shape, seed=9, strided=True)
        dy = torch.randn(B, s * l, generator=torch.Generator().manual_seed(10))
        grads = _torch_backward(dy, x, w1, w2)
        want = monarch_reference(x, w1, w2)
        ctx = f"{config_set} pipelined shape {shape}"
        _close("y", _pipelined_in_ten_tiles(x, w1, w2, config_set), want, ctx)
        y, h = _pipelined_in_ten_tiles(x, w1, w2, config_set, keep=True)
        _close("y", y, want, f"{ctx}, intermediate kept")
        _close("h", h, monarch_forward(x, w1, w2, path="two_kernel", keep=True)[1], ctx)
        for path in ("two_kernel", "three_kernel", "blas", "chunked"):
            ctx = f"{config_set} {path} shape {shape}"
            # chunked: 128 and 22 rows, 3 splits each (two, one of them with rows)
            rows = 128 if path == "chunked" else None
            _close("y", monarch_forward(x, w1, w2, path=path, chunk_rows=rows), want, ctx)
            got = monarch_backward(dy, x, w1, w2, path=path, splits=3, chunk_rows=rows)
            for name, a, b in zip(("dx", "dw1", "dw2"), got, grads, strict=True):
                _close(name, a, b, f"{ctx} backward in 3 splits")
            count += 1
    return count


def _pipelined_in_ten_tiles(x, w1, w2, config_set: str, keep: bool = False):
    """The pipelined forward with 16-row tiles (150 rows: ten, the last partial) and one round
    between stages, so that its four scratch slots are each reused: a stage-1 item waits for
    the transposes of the tile four before it. Three programs share the work. With ``keep``,
    ``(y, h)``."""
    import triton
    from monarch_kernels import forward_launch, pipeline_launch

    cfg = _configs(config_set, "pipeline")[0]
    cfg = triton.Config({**cfg.kwargs, "BLOCK_M": 16}, num_warps=cfg.num_warps)
    lag, pipeline_launch.PIPELINE_LAG = pipeline_launch.PIPELINE_LAG, 1
    try:
        return forward_launch.monarch_forward(
            x, w1, w2, path="pipelined", configs={"pipeline": cfg}, num_programs=3, keep=keep
        )
    finally:
        pipeline_launch.PIPELINE_LAG = lag


def check_op() -> int:
    """The custom op and its autograd routed to the kernels (any batch dims, strided input)."""
    import torch
    from monarch_kernels import (
        backward_launch,
        forward_launch,
        monarch_matmul,
        monarch_reference,
        ops,
        triton_launch,
    )

    launches = []
    for module, name in (
        (forward_launch, "monarch_forward"),
        (backward_launch, "monarch_backward"),
    ):
        fn = getattr(module, name)
        setattr(
            module,
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


def check_replay() -> int:
    """Launch plans (``replay.py``): calls after the second repeat the recorded launches on
    new tensors; every call's results must still be the reference's."""
    import torch
    from monarch_kernels import (
        backward_launch,
        forward_launch,
        monarch_reference,
        replay,
    )
    from monarch_kernels.ops import _torch_backward

    replay.ENABLED = True  # off under the interpreter by default
    replays = []
    replay_of = replay.Plan.replay
    replay.Plan.replay = lambda self, inputs: replays.append(self) or replay_of(self, inputs)
    count = 0
    for i, shape in enumerate(SHAPES):
        B, _k, _p, _q, l, s = shape
        variants = (("two_kernel", "plain"), ("three_kernel", "strided"), (None, "offset"))
        for path, variant in variants:
            for call in range(4):  # new tensors each call: a plan must not keep the old ones
                x, w1, w2 = _inputs(shape, seed=10 * i + call, strided=variant == "strided")
                if variant == "offset":  # x starts 4 bytes into its storage
                    x = torch.cat([torch.zeros(B, 1), x], 1)[:, 1:]
                dy = torch.randn(B, s * l, generator=torch.Generator().manual_seed(call))
                ctx = f"replay path={path} shape {shape} call {call}"
                y, h = forward_launch.monarch_forward(x, w1, w2, path=path, keep=True)
                _close("y", y, monarch_reference(x, w1, w2), ctx)
                got = backward_launch.monarch_backward(dy, x, w1, w2, path=path, h=h)
                want = _torch_backward(dy, x, w1, w2)
                for name, a, b in zip(("dx", "dw1", "dw2"), got, want, strict=True):
                    _close(name, a, b, ctx)
                count += 1
        # dy read through a transpose: the launcher copies it (a torch op), so no plan
        x, w1, w2 = _inputs(shape, seed=i, strided=False)
        dy = torch.randn(s * l, B, generator=torch.Generator().manual_seed(i)).t()
        before = len(replays)
        for _ in range(3):
            got = backward_launch.monarch_backward(dy, x, w1, w2, path="two_kernel")
            want = _torch_backward(dy, x, w1, w2)
            for name, a, b in zip(("dx", "dw1", "dw2"), got, want, strict=True):
                _close(name, a, b, f"unplanned backward, shape {shape}")
        if len(replays) != before:
            raise AssertionError("a call whose launcher copies a tensor was replayed")
    # per shape and path, forward and backward replay the third call
    if len(replays) < 2 * 3 * len(SHAPES):
        raise AssertionError(f"only {len(replays)} calls were replayed")
    return count


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if sys.argv[2] in ("op", "replay"):
        n = check_op() if sys.argv[2] == "op" else check_replay()
    else:
        n = check(sys.argv[1], sys.argv[2])
    print(f"{n} checks passed")
