"""What a rank's device is, said once as it is set up: the GPU its local rank picks (CUDA or
ROCm), made the current device, or the CPU."""

from __future__ import annotations

import platform
from typing import Any


def describe(local_rank: int) -> dict[str, Any]:
    """kind (cuda, rocm, cpu), the torch device, its name and memory in bytes."""
    import psutil
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        props = torch.cuda.get_device_properties(index)
        return {
            "kind": "rocm" if torch.version.hip else "cuda",
            "torch": f"cuda:{index}",
            "name": props.name,
            "memory": props.total_memory,
        }
    return {
        "kind": "cpu",
        "torch": "cpu",
        "name": platform.processor() or platform.machine() or "cpu",
        "memory": psutil.virtual_memory().total,
    }
