"""``MonarchLinear``: a drop-in for ``nn.Linear`` with a Monarch weight."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .ops import monarch_matmul
from .projection import project_to_monarch


class MonarchLinear(nn.Module):
    """``y = x @ M.T + b`` with M a Monarch matrix of ``nblocks`` blocks per factor.

    Any ``in_features``/``out_features``: the input is zero-padded to a multiple of
    ``nblocks`` and the output truncated, as in the paper's code. Parameters:
    ``w1`` (nblocks, q, in_blk) and ``w2`` (nblocks, out_blk, q) with ``q = min(in_blk, out_blk)``,
    in the layout of :func:`monarch_kernels.monarch_matmul`.

    >>> layer = MonarchLinear(100, 60, nblocks=4)
    >>> layer(torch.randn(8, 100)).shape
    torch.Size([8, 60])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        nblocks: int = 4,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"MonarchLinear: {name} must be an int, got {value!r}")
        if not isinstance(nblocks, int) or isinstance(nblocks, bool):
            raise TypeError(f"MonarchLinear: nblocks must be an int, got {nblocks!r}")
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"MonarchLinear: in_features={in_features} and out_features={out_features} "
                "must be >= 1"
            )
        if nblocks < 1:
            raise ValueError(f"MonarchLinear: nblocks={nblocks} must be >= 1")
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.nblocks = nblocks
        in_blk = math.ceil(in_features / nblocks)
        out_blk = math.ceil(out_features / nblocks)
        self.in_features_padded = in_blk * nblocks
        self.out_features_padded = out_blk * nblocks
        q = min(in_blk, out_blk)
        if q < nblocks and in_features * out_features > 1:
            warnings.warn(
                f"MonarchLinear({in_features}, {out_features}, nblocks={nblocks}): blocks of "
                f"{q} < {nblocks}, so each output reaches only {q} of the {nblocks} input blocks; "
                f"nblocks={_connected_blocks(in_features, out_features)} connects every input "
                "to every output",
                UserWarning,
                stacklevel=2,
            )
        self.w1 = nn.Parameter(torch.empty(nblocks, q, in_blk, **factory))
        self.w2 = nn.Parameter(torch.empty(nblocks, out_blk, q, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default gives Var(y) = E[x^2] / 3. Stage 1 keeps the variance
        # (Var(w1) = 1 / fan_in, counting real inputs per block); stage 2 divides it by 3.
        fan_in1 = self.in_features / self.nblocks
        fan_in2 = self.w2.shape[-1]
        nn.init.uniform_(self.w1, -math.sqrt(3.0 / fan_in1), math.sqrt(3.0 / fan_in1))
        nn.init.uniform_(self.w2, -1.0 / math.sqrt(fan_in2), 1.0 / math.sqrt(fan_in2))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"MonarchLinear: expected input (..., {self.in_features}), got {tuple(x.shape)}"
            )
        if self.in_features_padded != self.in_features:
            x = nn.functional.pad(x, (0, self.in_features_padded - self.in_features))
        y = monarch_matmul(x, self.w1, self.w2)
        if self.out_features_padded != self.out_features:
            y = y[..., : self.out_features]
        # in y's dtype, which differs from the bias's only under autocast (as nn.Linear's)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, nblocks: int = 4) -> MonarchLinear:
        """A MonarchLinear whose weight is the Frobenius-nearest Monarch matrix to ``linear``'s."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            nblocks=nblocks,
            bias=linear.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        padded = w.new_zeros(layer.out_features_padded, layer.in_features_padded)
        padded[: w.shape[0], : w.shape[1]] = w.detach()
        w1, w2 = project_to_monarch(padded, nblocks, q=layer.w1.shape[1])
        with torch.no_grad():
            layer.w1.copy_(w1)
            layer.w2.copy_(w2)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def dense_weight(self) -> torch.Tensor:
        """The ``(out_features, in_features)`` dense matrix this layer multiplies by."""
        eye = torch.eye(self.in_features, dtype=self.w1.dtype, device=self.w1.device)
        eye = nn.functional.pad(eye, (0, self.in_features_padded - self.in_features))
        return monarch_matmul(eye, self.w1, self.w2)[:, : self.out_features].T

    def extra_repr(self) -> str:
        params = self.w1.numel() + self.w2.numel()
        dense = self.in_features * self.out_features
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"nblocks={self.nblocks}, bias={self.bias is not None}, "
            f"weight params={params} vs dense {dense} ({params / dense:.1%})"
        )


def _connected_blocks(in_features: int, out_features: int) -> int:
    """The most blocks for which every output of the layer depends on every input: output
    block j reads one element of each of ``q`` stage-1 blocks, so all ``nblocks`` are
    reached when ``q = min(ceil(in / nblocks), ceil(out / nblocks)) >= nblocks``."""
    return max(
        b
        for b in range(1, min(in_features, out_features) + 1)
        if min(math.ceil(in_features / b), math.ceil(out_features / b)) >= b
    )
