# ruff: noqa: E741
# (k, q, p, l, s, r are the specification's names; l is a block count.)
"""``ShardedMonarchLinear``: a Monarch layer split by blocks across the ranks of a mesh dimension.

With ``d`` ranks, rank t holds blocks ``[t*k/d, (t+1)*k/d)`` of ``w1`` and ``[t*l/d, (t+1)*l/d)``
of ``w2`` (and the bias of the outputs those w2 blocks write). The forward is

1. stage 1 on the rank's own k/d blocks (local ``torch.bmm``), giving rows
   ``[t*k*q/d, (t+1)*k*q/d)`` of the intermediate;
2. ONE all-to-all: row ``m = rr*l + j`` goes to the rank that owns stage-2 block j, which is
   the specification's ``(r l) -> (l r)`` permutation; rows that stay on their rank are not
   sent;
3. stage 2 on the rank's own l/d blocks (local ``torch.bmm``).

The backward is the same three steps transposed (the all-to-all with the splits swapped), by
autograd, so every gradient equals the unsharded layer's.

Layouts, for a layer of ``in_features`` n and ``out_features`` o (padded to ``k*p`` and ``s*l``
as in :class:`~monarch_kernels.MonarchLinear`):

* ``input_layout="replicated"``: every rank passes the whole ``(..., n)`` and keeps its chunk
  of the padded input (no collective). Backward: an all-gather of the input gradient's chunks,
  so every rank gets the whole gradient (none where the input needs no gradient).
* ``input_layout="sharded"``: rank t passes chunk t of the input padded to ``k*p``:
  ``(..., k*p/d)``, the inputs of its stage-1 blocks. No collective either way.
* ``output_layout="replicated"``: every rank gets the whole ``(..., o)``. Forward: an
  all-gather; backward: none (each rank takes its part of the output's gradient, which the
  ranks agree on because each computed the same thing from the same output).
* ``output_layout="sharded"``: rank t gets the contiguous chunk t, ``(..., o/d)``, which is
  what the next layer's ``input_layout="sharded"`` takes. One more all-to-all each way; needs
  ``o == s*l`` (no padding).
* ``output_layout="blocks"``: rank t gets its stage-2 blocks' outputs as computed,
  ``y.view(..., s, l)[..., t*l/d:(t+1)*l/d]`` flattened to ``(..., s*l/d)``, padding included.
  No collective.

:func:`monarch_kernels.monarch_tp_bytes` counts the bytes each option moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .blas import stage_one
from .layers import MonarchLinear
from .reference import monarch_shapes

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which older torch lacks
_all_gather = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
INPUT_LAYOUTS = ("replicated", "sharded")
OUTPUT_LAYOUTS = ("replicated", "sharded", "blocks")


def resolve_group(mesh=None, dim: str | None = None, *, who: str = "ShardedMonarchLinear"):
    """The process group to shard over: the default group (``mesh=None``), a ``ProcessGroup``,
    a 1-d ``DeviceMesh``, or the dimension named ``dim`` of a ``DeviceMesh``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{who}: no torch.distributed process group is initialised; call "
            "torch.distributed.init_process_group(...) (or init_device_mesh) on every rank first"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names
        if dim is None:
            if mesh.ndim != 1:
                raise ValueError(
                    f"{who}: the mesh has {mesh.ndim} dimensions {names}; name the one to shard "
                    "over with dim=..."
                )
            return mesh.get_group()
        if names is None or dim not in names:
            raise ValueError(
                f"{who}: dim={dim!r} is not a dimension of the mesh, whose dimensions are "
                f"{names}; pass one of those names"
            )
        return mesh.get_group(dim)
    if dim is not None:
        raise ValueError(f"{who}: dim={dim!r} names a mesh dimension, but no DeviceMesh was given")
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(
        f"{who}: mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
    )


def check_divisible(count: int, label: str, world: int) -> None:
    """One line naming the block counts and mesh sizes that would fit."""
    if count % world == 0:
        return
    below, above = count - count % world, count - count % world + world
    counts = f"{below} or {above}" if below else f"{above}"
    fits = ", ".join(str(v) for v in range(1, count + 1) if count % v == 0)
    raise ValueError(
        f"ShardedMonarchLinear: {label}={count} is not divisible by the {world} ranks of the "
        f"mesh dimension; use {label}={counts}, or a mesh dimension of size {fits}"
    )


@dataclass(frozen=True)
class Route:
    """One all-to-all that moves rows from one sharded layout to another, for one rank.

    ``send_index`` orders the rank's rows by destination (None: already in order);
    ``in_splits[u]`` rows go to rank u and ``out_splits[t]`` come from rank t;
    ``recv_index`` puts the received rows in the destination's order (None: they arrive so)."""

    send_index: torch.Tensor | None
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    recv_index: torch.Tensor | None

    def sent_rows(self, rank: int, backward: bool = False) -> int:
        """Rows this rank sends to other ranks in the forward (or the backward)."""
        splits = self.out_splits if backward else self.in_splits
        return sum(splits) - splits[rank]


def route(
    src: torch.Tensor,
    src_pos: torch.Tensor,
    dst: torch.Tensor,
    dst_pos: torch.Tensor,
    world: int,
    rank: int,
) -> Route:
    """The route for ``rank`` of rows whose owner and local position are ``src``/``src_pos``
    before and ``dst``/``dst_pos`` after (one entry per global row)."""
    n = src.numel()
    mine = src == rank
    order = torch.argsort(dst[mine] * n + dst_pos[mine])  # by destination, then its position
    send = src_pos[mine][order]
    to_me = dst == rank
    # rows arrive grouped by source rank, each group in the destination's order
    arrival = dst_pos[to_me][torch.argsort(src[to_me] * n + dst_pos[to_me])]
    recv = torch.argsort(arrival)  # out[i] = received[recv[i]]

    def unless_identity(index: torch.Tensor) -> torch.Tensor | None:
        return None if torch.equal(index, torch.arange(index.numel())) else index

    return Route(
        unless_identity(send),
        tuple(torch.bincount(dst[mine], minlength=world).tolist()),
        tuple(torch.bincount(src[to_me], minlength=world).tolist()),
        unless_identity(recv),
    )


def permutation_route(k: int, q: int, l: int, world: int, rank: int) -> Route:
    """The Monarch permutation: intermediate row ``m = rr*l + j`` (stage-1 block m // q) moves
    from the rank holding stage-1 block ``m // q`` to row ``rr*l/d + j % (l/d)`` of the rank
    holding stage-2 block j."""
    m = torch.arange(k * q)
    rows, l_loc = k * q // world, l // world
    return route(m // rows, m % rows, m % l // l_loc, m // l * l_loc + m % l_loc, world, rank)


def output_route(l: int, s: int, world: int, rank: int) -> Route:
    """Output ``c = a*l + j``, row ``(j % (l/d))*s + a`` of the feature-major stage-2 result on
    the rank holding block j, to position ``c % (s*l/d)`` of contiguous chunk ``c*d // (s*l)``."""
    c = torch.arange(s * l)
    j, a, l_loc, width = c % l, c // l, l // world, s * l // world
    return route(j // l_loc, j % l_loc * s + a, c // width, c % width, world, rank)


class _AllToAll(torch.autograd.Function):
    """Rows (dim 0) to other ranks: ``in_splits[u]`` rows to rank u, ``out_splits[t]`` from
    rank t; the backward sends the gradient's rows back the same way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, in_splits, out_splits) -> torch.Tensor:
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        in_splits, out_splits = ctx.splits
        return _AllToAll.apply(grad, ctx.group, out_splits, in_splits), None, None, None


class _AllGather(torch.autograd.Function):
    """``(d, *x.shape)`` from every rank's ``x``; the backward keeps this rank's part of the
    gradient, which every rank holds whole (a replicated output, as Megatron's gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        ctx.rank = rank
        out = x.new_empty(world * x.shape[0], *x.shape[1:])  # the shape gloo and NCCL take
        _all_gather(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None, None, None


class _Split(torch.autograd.Function):
    """This rank's part ``x[rank]`` of a replicated ``(d, ...)``; the backward all-gathers the
    parts' gradients so that every rank gets the whole replicated input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        ctx.group, ctx.world = group, world
        return x[rank]  # a view: stage 1 reads it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllGather.apply(grad, ctx.group, 0, ctx.world), None, None, None


class ShardedMonarchLinear(nn.Module):
    """A Monarch layer ``y = x @ M.T + b`` whose blocks are split across the ranks of ``mesh``
    (a ``DeviceMesh``, or its dimension named ``dim``; a ``ProcessGroup``; None: the default
    group). ``w1``, ``w2`` and ``bias`` are the whole layer's, the same on every rank; each
    rank keeps its share (module docstring: layouts and the collectives each costs).

    Parameters, this rank's share: ``w1`` (k/d, q, p), ``w2`` (l/d, s, r) and ``bias``
    (s*l/d,) in the ``"blocks"`` output order, zero at padded outputs.

    On every rank of a mesh with a dimension "tp", from one seed::

        torch.manual_seed(0)
        layer = ShardedMonarchLinear.from_linear(MonarchLinear(1024, 512), mesh, "tp")
        layer(torch.randn(8, 1024))  # (8, 512), as the MonarchLinear's
    """

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        mesh=None,
        dim: str | None = None,
        in_features: int | None = None,
        out_features: int | None = None,
        input_layout: str = "replicated",
        output_layout: str = "replicated",
    ) -> None:
        super().__init__()
        k, q, p = w1.shape if w1.dim() == 3 else (0, 0, 0)  # monarch_shapes names a bad w1
        k, q, p, l, s, r = monarch_shapes(k * p, w1, w2)
        in_features = k * p if in_features is None else in_features
        out_features = s * l if out_features is None else out_features
        if not 0 < in_features <= k * p or not 0 < out_features <= s * l:
            raise ValueError(
                f"ShardedMonarchLinear: in_features={in_features} and out_features="
                f"{out_features} must be in 1..{k * p} and 1..{s * l} for w1 {tuple(w1.shape)} "
                f"and w2 {tuple(w2.shape)}"
            )
        for name, value, allowed in (
            ("input_layout", input_layout, INPUT_LAYOUTS),
            ("output_layout", output_layout, OUTPUT_LAYOUTS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"ShardedMonarchLinear: {name}={value!r}; use one of {', '.join(allowed)}"
                )
        if output_layout == "sharded" and out_features != s * l:
            raise ValueError(
                f"ShardedMonarchLinear: output_layout='sharded' needs out_features "
                f"({out_features}) to fill the {l} blocks of {s} outputs ({s * l}); use "
                "'replicated' or 'blocks'"
            )
        group = resolve_group(mesh, dim)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divisible(k, "nblocks" if k == l else "k (w1's blocks)", world)
        check_divisible(l, "l (w2's blocks)", world)
        self.group, self.world, self.rank = group, world, rank
        self.in_features, self.out_features = in_features, out_features
        self.shapes = (k, q, p, l, s, r)
        self.input_layout, self.output_layout = input_layout, output_layout
        k_loc, l_loc = k // world, l // world
        self.w1 = nn.Parameter(w1.detach()[rank * k_loc : (rank + 1) * k_loc].clone())
        self.w2 = nn.Parameter(w2.detach()[rank * l_loc : (rank + 1) * l_loc].clone())
        if bias is None:
            self.register_parameter("bias", None)
        else:
            padded = bias.detach().new_zeros(s * l)
            padded[:out_features] = bias.detach()
            mine = padded.view(s, l)[:, rank * l_loc : (rank + 1) * l_loc]
            self.bias = nn.Parameter(mine.reshape(-1).clone())
        self.routes = {"perm": permutation_route(k, q, l, world, rank)}
        if output_layout == "sharded":
            self.routes["out"] = output_route(l, s, world, rank)
        # the routes' indices as buffers, so that .to(device) moves them with the weights
        for name, way in self.routes.items():
            for end, index in (("send", way.send_index), ("recv", way.recv_index)):
                index = None if index is None else index.to(w1.device)
                self.register_buffer(f"_{name}_{end}", index, persistent=False)

    @classmethod
    def from_linear(
        cls,
        layer: MonarchLinear,
        mesh=None,
        dim: str | None = None,
        *,
        input_layout: str = "replicated",
        output_layout: str = "replicated",
    ) -> ShardedMonarchLinear:
        """This rank's share of ``layer`` (the same layer on every rank: build it from one
        seed, or load one checkpoint)."""
        if not isinstance(layer, MonarchLinear):
            raise TypeError(
                f"ShardedMonarchLinear.from_linear: expected a MonarchLinear, got "
                f"{type(layer).__name__}"
            )
        return cls(
            layer.w1,
            layer.w2,
            layer.bias,
            mesh=mesh,
            dim=dim,
            in_features=layer.in_features,
            out_features=layer.out_features,
            input_layout=input_layout,
            output_layout=output_layout,
        )

    @property
    def local_in_features(self) -> int:
        """The input width each rank passes with ``input_layout="sharded"``: k*p/d."""
        k, _q, p, *_ = self.shapes
        return k * p // self.world

    @property
    def local_out_features(self) -> int:
        """The output width with ``output_layout="sharded"`` (o/d) or ``"blocks"`` (s*l/d)."""
        *_, l, s, _r = self.shapes
        return s * l // self.world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, _q, p, l, s, r = self.shapes
        width = self.in_features if self.input_layout == "replicated" else self.local_in_features
        if x.shape[-1] != width:
            raise ValueError(
                f"ShardedMonarchLinear: expected a {self.input_layout} input (..., {width}), "
                f"got {tuple(x.shape)}"
            )
        batch = x.shape[:-1]
        x2 = x.reshape(-1, width)
        b = x2.shape[0]
        if self.input_layout == "replicated":
            x2 = nn.functional.pad(x2, (0, k * p - width))
            # (d, B, k*p/d): chunk t holds the inputs of rank t's stage-1 blocks
            x2 = x2.unflatten(1, (self.world, -1)).transpose(0, 1)
            if x.requires_grad and torch.is_grad_enabled():
                x2 = _Split.apply(x2, self.group, self.rank, self.world)
            else:
                x2 = x2[self.rank]
        ht = stage_one(x2, self.w1)  # (k/d, q, B): this rank's rows of the intermediate
        g = self._moved(ht.view(-1, b), "perm")
        g = g.view(r, l // self.world, b).transpose(0, 1)  # (l/d, r, B): stage 2's operands
        yt = torch.bmm(self.w2, g)  # (l/d, s, B): y[b, a*l + j] = yt[j - t*l/d, a, b]
        if self.bias is not None:
            yt = yt + self.bias.view(s, -1).t().unsqueeze(-1).to(yt.dtype)
        if self.output_layout == "blocks":
            y = yt.permute(2, 1, 0).reshape(b, -1)
        elif self.output_layout == "sharded":
            y = self._moved(yt.reshape(-1, b), "out").t()  # (B, o/d), feature-major
        else:  # (d, l/d, s, B) is (l, s, B) whole
            yt = _AllGather.apply(yt, self.group, self.rank, self.world)
            y = yt.view(l, s, b).permute(2, 1, 0).reshape(b, s * l)[:, : self.out_features]
        return y.reshape(*batch, y.shape[-1])

    def _moved(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """``rows`` (N, B) moved by the route ``name``: the rank's rows of the new layout."""
        way, send, recv = (
            self.routes[name],
            getattr(self, f"_{name}_send"),
            getattr(self, f"_{name}_recv"),
        )
        if send is not None:
            rows = rows.index_select(0, send)
        rows = _AllToAll.apply(rows, self.group, way.in_splits, way.out_splits)
        return rows if recv is None else rows.index_select(0, recv)

    def extra_repr(self) -> str:
        k, q, p, l, s, r = self.shapes
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"w1 {k}x{q}x{p} and w2 {l}x{s}x{r} of which rank {self.rank} of {self.world} holds "
            f"{k // self.world} and {l // self.world} blocks, input_layout={self.input_layout!r}, "
            f"output_layout={self.output_layout!r}"
        )


def shard_monarch(module: nn.Module, mesh=None, dim: str | None = None) -> nn.Module:
    """``module`` with every :class:`MonarchLinear` in it replaced by this rank's
    :class:`ShardedMonarchLinear` share, input and output replicated: the model computes what it
    did, each layer costing an all-to-all and an all-gather each way (the module itself is
    returned sharded if it is a MonarchLinear)."""
    resolve_group(mesh, dim, who="shard_monarch")  # one line before anything is replaced
    if isinstance(module, MonarchLinear):
        return ShardedMonarchLinear.from_linear(module, mesh, dim)
    for name, child in list(module.named_children()):
        setattr(module, name, shard_monarch(child, mesh, dim))
    return module
