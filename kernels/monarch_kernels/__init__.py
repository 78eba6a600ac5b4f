"""Monarch structured-matrix kernels: reference math, Triton kernels, layers, projection, and
layers sharded by block across ranks (tensor parallelism)."""

from .layers import MonarchLinear
from .ops import monarch_matmul
from .projection import project_to_monarch
from .reference import monarch_dense, monarch_reference
from .sharded import ShardedMonarchLinear, shard_monarch
from .tp_bytes import CommBytes, dense_tp_bytes, monarch_tp_bytes

__all__ = [
    "CommBytes",
    "MonarchLinear",
    "ShardedMonarchLinear",
    "dense_tp_bytes",
    "monarch_dense",
    "monarch_matmul",
    "monarch_reference",
    "monarch_tp_bytes",
    "project_to_monarch",
    "shard_monarch",
]
