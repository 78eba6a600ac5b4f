"""Monarch structured-matrix kernels: reference math, Triton kernels, layers, projection."""

from .layers import MonarchLinear
from .ops import monarch_matmul
from .projection import project_to_monarch
from .reference import monarch_dense, monarch_reference

__all__ = [
    "MonarchLinear",
    "monarch_dense",
    "monarch_matmul",
    "monarch_reference",
    "project_to_monarch",
]
