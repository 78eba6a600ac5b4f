# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""``monarch_kernels::monarch_matmul``: the Monarch product as one opaque ``torch.library`` op.

On a GPU (CUDA or ROCm) the op runs the Triton kernels; everywhere else, or when Triton is
absent or too old, it runs the torch path below.

The torch path works "batch-last" (see :mod:`monarch_kernels.blas`): the permutation between
the stages is a leading dimension that BLAS accepts, so it is never copied. What is left is
putting ``(l, s, B)`` into the output's order: a copy of whole rows of B elements and one 2-d
transpose, where the two-bmm pipeline copies the intermediate and then gathers the output with
a 3-d permutation.

Eager calls run the same bodies through a plain ``torch.autograd.Function``, which costs the
host far less per call than a Python custom op; ``torch.compile``, fake tensors and export see
the custom ops. Under functorch transforms (``jvp``, ``grad``, ``vmap``, ``jacfwd``) the
product is composed of plain torch ops, which every transform differentiates and batches: the
custom ops' autograd is backward-only.
"""

from __future__ import annotations

import warnings

import torch

from . import blas
from .reference import monarch_shapes

_MIN_TRITON = (3, 0)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 takes the torch path
_triton_state: dict[str, object] = {}


def _check(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[int, ...]:
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"monarch_matmul: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"monarch_matmul: {name} has dtype {t.dtype}; expected a floating dtype "
                "(float32, float16, bfloat16 or float64)"
            )
    if not (x.dtype == w1.dtype == w2.dtype):
        raise TypeError(
            f"monarch_matmul: mixed dtypes x={x.dtype}, w1={w1.dtype}, w2={w2.dtype}; "
            "cast them to one dtype"
        )
    if not (x.device == w1.device == w2.device):
        raise ValueError(
            f"monarch_matmul: tensors on different devices x={x.device}, w1={w1.device}, "
            f"w2={w2.device}; move them to one device"
        )
    if x.dim() < 1:
        raise ValueError("monarch_matmul: x must have at least one dimension (..., n)")
    return monarch_shapes(x.shape[-1], w1, w2)


def _use_triton(device: torch.device) -> bool:
    """True when ``device`` is a GPU and a recent enough Triton is importable (warns once if
    not)."""
    if device.type != "cuda":
        return False
    if "ok" not in _triton_state:
        reason = None
        try:
            import triton

            version = tuple(int(v) for v in triton.__version__.split(".")[:2])
            if version < _MIN_TRITON:
                reason = (
                    f"Triton {triton.__version__} is older than {'.'.join(map(str, _MIN_TRITON))}"
                )
            else:
                from . import triton_launch  # noqa: F401
        except Exception as exc:  # an unparsable version, a failing import: fall back, not crash
            reason = f"Triton is not usable ({type(exc).__name__}: {exc})"
        _triton_state["ok"] = reason is None
        if reason is not None:
            warnings.warn(
                f"monarch_kernels: {reason}; using the torch path on {device}",
                RuntimeWarning,
                stacklevel=3,
            )
    return bool(_triton_state["ok"])


def _torch_forward(
    x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)``: the output, a tensor of its own, and the feature-major intermediate ``h.T``
    (k*q, B)."""
    ht, yt = blas.forward_stages(x2, w1, w2)
    l, s, b = yt.shape
    # (l, s, B) -> (s, l, B) moves rows of B contiguous elements; then one 2-d transpose, copied
    # even where it is contiguous already (one row): the output is never a view
    y = yt.transpose(0, 1).reshape(s * l, b).t().clone(memory_format=torch.contiguous_format)
    return y, ht.view(-1, b)


def _torch_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, q, _p = w1.shape
    l, s, _r = w2.shape
    b = x2.shape[0]
    dyt = dy2.t().contiguous().view(s, l, b).transpose(0, 1)  # (l, s, B): dY.T per block
    dht, dx = blas.input_grads(dyt, w1, w2, strided_out=False)
    # stage 1 as the forward kept it, or recomputed: (k, q, B)
    ht = h.view(k, q, b) if h is not None else blas.stage_one(x2, w1)
    dw1, dw2 = blas.weight_grads(dyt, dht, x2, ht, l)
    return dx, dw1, dw2


def _forward(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, keep: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, h)``: the product as rows ``(B, s*l)``, B the batch dimensions flattened, and,
    with ``keep`` (or where it comes free), the feature-major intermediate (k*q, B) for the
    backward. The body of every route below; each views y in the batch's shape itself, so
    that the eager route's autograd.Function returns no view (which autograd would refuse
    to let the caller modify in place)."""
    k, q, p, l, s, _r = _check(x, w1, w2)
    x2 = x.reshape(-1, k * p)
    if x2.shape[0] == 0:
        return x.new_zeros(0, s * l), x.new_zeros(k * q, 0)
    if x.dtype in _TRITON_DTYPES and _use_triton(x.device):
        from .triton_launch import monarch_forward

        if keep:
            y, h = monarch_forward(x2, w1, w2, keep=True)
        else:
            y, h = monarch_forward(x2, w1, w2), None
    else:
        y, h = _torch_forward(x2, w1, w2)
    return y, h


def _batched(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rows ``y`` (B, out) viewed in ``x``'s batch shape: (..., out); ``y`` itself where x is
    already 2-d."""
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _composite(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The product from plain torch ops (the torch path's two block products, then the output
    permutation as a view), which functorch's transforms differentiate in both modes and
    batch."""
    k, _q, p, l, s, _r = monarch_shapes(x.shape[-1], w1, w2)
    _ht, yt = blas.forward_stages(x.reshape(-1, k * p), w1, w2)
    return yt.permute(2, 1, 0).reshape(*x.shape[:-1], s * l)  # y[b, a*l + j] = yt[j, a, b]


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands as autocast casts a matmul's, where it is on for their device: floating
    tensors other than float64 to its dtype (``nn.Linear`` under autocast does the same)."""
    x = tensors[0]
    if not isinstance(x, torch.Tensor) or not torch.is_autocast_enabled(x.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(x.device.type)
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        else t
        for t in tensors
    )


def _gradients(
    grad: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dw1, dw2)`` for ``grad``; ``h`` (from ``_forward(keep=True)``) spares stage 1."""
    k, _q, p, l, s, _r = _check(x, w1, w2)
    x2 = x.reshape(-1, k * p)
    dy2 = grad.reshape(-1, s * l)
    if x2.shape[0] == 0:
        return x.new_zeros(x.shape), w1.new_zeros(w1.shape), w2.new_zeros(w2.shape)
    if x.dtype in _TRITON_DTYPES and _use_triton(x.device):
        from .triton_launch import monarch_backward

        dx, dw1, dw2 = monarch_backward(dy2, x2, w1, w2, h=h)
    else:
        dx, dw1, dw2 = _torch_backward(dy2, x2, w1, w2, h)
    return dx.view(x.shape), dw1, dw2


@torch.library.custom_op("monarch_kernels::monarch_matmul", mutates_args=())
def _monarch_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return _batched(_forward(x, w1, w2, keep=False)[0], x)


@_monarch_op.register_fake
def _(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    _k, _q, _p, l, s, _r = _check(x, w1, w2)
    return x.new_empty(*x.shape[:-1], s * l)


@torch.library.custom_op("monarch_kernels::monarch_matmul_keep", mutates_args=())
def _monarch_keep_op(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward for training: ``(y, h)``, h the feature-major intermediate (k*q, B) that the
    backward needs for ``dw2``. Every path writes h anyway; keeping it
    saves the backward a pass of stage 1 (one activation-sized tensor more held)."""
    y, h = _forward(x, w1, w2, keep=True)
    return _batched(y, x), h


@_monarch_keep_op.register_fake
def _(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, q, p, l, s, _r = _check(x, w1, w2)
    rows = x.numel() // (k * p) if x.numel() else 0
    return x.new_empty(*x.shape[:-1], s * l), x.new_empty(k * q, rows)


@torch.library.custom_op("monarch_kernels::monarch_matmul_backward", mutates_args=())
def _monarch_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gradients(grad, x, w1, w2, h)


@_monarch_backward_op.register_fake
def _(grad, x, w1, w2, h=None):
    # contiguous, like every real implementation's results
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def _setup_context(ctx, inputs, output):
    x, w1, w2 = inputs
    ctx.save_for_backward(x, w1, w2)


def _backward(ctx, grad):
    x, w1, w2 = ctx.saved_tensors
    dx, dw1, dw2 = torch.ops.monarch_kernels.monarch_matmul_backward(grad, x, w1, w2)
    return dx, dw1, dw2


torch.library.register_autograd(
    "monarch_kernels::monarch_matmul", _backward, setup_context=_setup_context
)


def _setup_keep_context(ctx, inputs, output):
    x, w1, w2 = inputs
    _y, h = output
    ctx.save_for_backward(x, w1, w2, h)


def _backward_keep(ctx, grad, _grad_h):
    x, w1, w2, h = ctx.saved_tensors
    dx, dw1, dw2 = torch.ops.monarch_kernels.monarch_matmul_backward(grad, x, w1, w2, h)
    return dx, dw1, dw2


torch.library.register_autograd(
    "monarch_kernels::monarch_matmul_keep", _backward_keep, setup_context=_setup_keep_context
)


class _MonarchMatmul(torch.autograd.Function):
    """The eager route for training: what ``monarch_matmul_keep`` and its registered backward
    compute, without the layers a Python custom op passes through on every call (dispatcher,
    autograd wrapper, alias checks, the compiler's guard). Those cost about as much host
    time as the kernels' launches (kernels/README.md, "Removing host overhead"); compiled
    code keeps the custom ops, which is what ``torch.compile`` needs to see."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Rows ``(B, s*l)``, never a view (the caller views them in the batch's shape)."""
        y, h = _forward(x, w1, w2, keep=True)
        ctx.save_for_backward(x, w1, w2, h)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, h = ctx.saved_tensors
        if not torch.is_grad_enabled():  # a plain backward: the kernels
            return _gradients(grad, x, w1, w2, h)
        # create_graph (a gradient penalty, MAML): the same gradients from plain torch ops,
        # whose graph autograd differentiates again (the kernels' would not be)
        _y, vjp = torch.func.vjp(_composite, x, w1, w2)
        needed = zip(vjp(grad), ctx.needs_input_grad, strict=True)
        return tuple(g if need else None for g, need in needed)


def _eager(*tensors: torch.Tensor) -> bool:
    """True where plain Python may stand in for the custom ops: outside ``torch.compile``'s
    tracing, on plain tensors and parameters, with no dispatch mode (fake tensors, export);
    elsewhere the ops keep their registered behaviour."""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
        and not torch._C._len_torch_dispatch_stack()
    )


def monarch_matmul(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Monarch product of ``x`` (..., k*p) with ``w1`` (k, q, p) and ``w2`` (l, s, r).

    Returns ``(..., s*l)``; see :mod:`monarch_kernels.reference` for the exact definition.
    Differentiable in all three arguments, also twice in eager code (``create_graph=True``);
    one opaque op under ``torch.compile``; under autocast, computed in its dtype as a matmul
    is.

    >>> x = torch.randn(8, 12); w1 = torch.randn(3, 4, 4); w2 = torch.randn(2, 5, 6)
    >>> monarch_matmul(x, w1, w2).shape
    torch.Size([8, 10])
    """
    x, w1, w2 = _autocast(x, w1, w2)
    _check(x, w1, w2)
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        return _composite(x, w1, w2)
    # keep the intermediate for the backward rather than recompute it there
    grad = torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad)
    if _eager(x, w1, w2):
        if grad:
            return _batched(_MonarchMatmul.apply(x, w1, w2), x)
        return _batched(_forward(x, w1, w2, keep=False)[0], x)
    if grad:
        return torch.ops.monarch_kernels.monarch_matmul_keep(x, w1, w2)[0]
    return torch.ops.monarch_kernels.monarch_matmul(x, w1, w2)
