"""What every benchmark prints about the machine and the software it ran on."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def cpu() -> str:
    """CPU model, usable cores and the OS, e.g. ``AMD EPYC, 2 usable cores, Linux 6.1``."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {usable} usable cores, {platform.system()} {platform.release()}"


def versions(packages: tuple[str, ...]) -> str:
    """``Python 3.11.7, torch 2.13.0, ...`` for the packages given."""
    parts = [f"Python {platform.python_version()}"]
    for pkg in packages:
        try:
            parts.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{pkg} (not installed)")
    return ", ".join(parts)
