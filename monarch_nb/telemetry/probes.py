"""One probe per library: amdsmi (ROCm), NVML (NVIDIA), torch.cuda (the fallback for either),
psutil (the worker process, on every kind). Each ``read()`` returns part of a Sample; a field a
library cannot give is ``None``, and a library that is missing, fails to start or fails on a
query degrades to fewer fields, never to an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from monarch_nb.telemetry.devices import cuda_target, hip_bdf, parse_bdf, torch_ids, uuid_hex

logger = logging.getLogger(__name__)

FAILURES_BEFORE_GIVING_UP = 3  # consecutive failures of one query before it is no longer asked
# The least wall time one CPU reading spans: a process's CPU time counts in clock ticks (10 ms),
# so a reading over a few ms is 0% or a multiple of hundreds.
CPU_WINDOW = 0.2


class _Probe:
    kind = "cpu"

    def __init__(self):
        self._failures: dict[str, int] = {}

    def _ask(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None when it fails; a query that keeps failing is no longer asked."""
        if self._failures.get(key, 0) >= FAILURES_BEFORE_GIVING_UP:
            return None
        try:
            value = fn()
        except Exception:
            self._failures[key] = self._failures.get(key, 0) + 1
            return None
        self._failures[key] = 0
        return value

    def close(self) -> None:
        pass


def _number(value: Any) -> float | None:
    """A reading as a float; the libraries say "N/A" (or a huge sentinel) when they have none."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if f != f or f < 0 or f >= 2**32 else f


class NvmlProbe(_Probe):
    """NVIDIA through ``pynvml`` (the ``nvidia-ml-py`` package)."""

    kind = "cuda"

    def __init__(self, index: int, env: Mapping[str, str] | None = None):
        super().__init__()
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        try:
            self.handle = self._find(index, os.environ if env is None else env)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        except BaseException:
            pynvml.nvmlShutdown()
            raise

    def _find(self, index: int, env: Mapping[str, str]):
        nv = self.nv
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        ids = torch_ids(index)
        if "uuid" in ids:
            for h in handles:
                if uuid_hex(nv.nvmlDeviceGetUUID(h)) == uuid_hex(ids["uuid"]):
                    return h
        if "bdf" in ids:
            for h in handles:
                if parse_bdf(nv.nvmlDeviceGetPciInfo(h).busId) == ids["bdf"]:
                    return h
        how, what = cuda_target(index, env)
        if how == "uuid":
            match = [
                h for h in handles if uuid_hex(nv.nvmlDeviceGetUUID(h)).startswith(uuid_hex(what))
            ]
            if len(match) == 1:
                return match[0]
            raise LookupError(f"no single NVML device has UUID {what}")
        if what < len(handles):
            return handles[what]
        raise LookupError(f"NVML sees {len(handles)} devices, not index {what}")

    def read(self) -> dict[str, Any]:
        nv, h = self.nv, self.handle
        mem = self._ask("mem", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power = self._ask("power", lambda: nv.nvmlDeviceGetPowerUsage(h))  # mW
        return {
            "device": self.name,
            "util": _number(self._ask("util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)),
            "mem_used": int(mem.used) if mem is not None else None,
            "mem_total": int(mem.total) if mem is not None else None,
            "power": _number(power / 1000) if power is not None else None,
            "temp": _number(
                self._ask("temp", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            ),
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


class AmdSmiProbe(_Probe):
    """AMD GPUs through ``amdsmi`` (ships with ROCm; not on PyPI for every platform)."""

    kind = "rocm"

    def __init__(self, index: int, env: Mapping[str, str] | None = None, root: str | Path = "/"):
        super().__init__()
        import amdsmi

        self.smi = amdsmi
        amdsmi.amdsmi_init()
        try:
            self.handle = self._find(index, os.environ if env is None else env, root)
            info = self._ask("name", lambda: amdsmi.amdsmi_get_gpu_asic_info(self.handle))
            self.name = (info or {}).get("market_name") or "AMD GPU"
        except BaseException:
            amdsmi.amdsmi_shut_down()
            raise

    def _find(self, index: int, env: Mapping[str, str], root):
        smi = self.smi
        handles = list(smi.amdsmi_get_processor_handles())
        want = torch_ids(index).get("bdf") or hip_bdf(index, env, root)
        if want is None:
            raise LookupError(f"cannot tell the PCI address of HIP device {index}")
        for h in handles:
            if parse_bdf(smi.amdsmi_get_gpu_device_bdf(h)) == want:
                return h
        raise LookupError(f"amdsmi has no GPU at PCI {want[0]:04x}:{want[1]:02x}:{want[2]:02x}")

    def _memory(self) -> tuple[int | None, int | None]:
        smi, h = self.smi, self.handle
        vram = getattr(getattr(smi, "AmdSmiMemoryType", None), "VRAM", None)
        used = self._ask("mem_used", lambda: smi.amdsmi_get_gpu_memory_usage(h, vram))
        total = self._ask("mem_total", lambda: smi.amdsmi_get_gpu_memory_total(h, vram))
        if used is None or total is None:
            # Older amdsmi: only the VRAM summary, in MB.
            usage = self._ask("vram", lambda: smi.amdsmi_get_gpu_vram_usage(h)) or {}
            mb = 1024 * 1024
            u, t = _number(usage.get("vram_used")), _number(usage.get("vram_total"))
            used = used if used is not None else (int(u * mb) if u is not None else None)
            total = total if total is not None else (int(t * mb) if t is not None else None)
        return (int(used) if used is not None else None, int(total) if total is not None else None)

    def _power(self) -> float | None:
        info = self._ask("power", lambda: self.smi.amdsmi_get_power_info(self.handle)) or {}
        # MI300 reports current_socket_power; older parts only average_socket_power.
        for key in ("current_socket_power", "average_socket_power", "socket_power"):
            value = _number(info.get(key))
            if value is not None:
                return value
        return None

    def _temp(self) -> float | None:
        smi = self.smi
        kinds = getattr(smi, "AmdSmiTemperatureType", None)
        metric = getattr(getattr(smi, "AmdSmiTemperatureMetric", None), "CURRENT", None)
        # The edge sensor is absent on MI300; the hotspot (junction) one exists everywhere.
        for name in ("EDGE", "HOTSPOT", "JUNCTION"):
            sensor = getattr(kinds, name, None)
            if sensor is None:
                continue
            value = _number(
                self._ask(
                    f"temp_{name}",
                    lambda s=sensor: smi.amdsmi_get_temp_metric(self.handle, s, metric),
                )
            )
            if value is not None:
                return value
        return None

    def read(self) -> dict[str, Any]:
        activity = self._ask("util", lambda: self.smi.amdsmi_get_gpu_activity(self.handle)) or {}
        used, total = self._memory()
        return {
            "device": self.name,
            "util": _number(activity.get("gfx_activity")),
            "mem_used": used,
            "mem_total": total,
            "power": self._power(),
            "temp": self._temp(),
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.smi.amdsmi_shut_down()


class TorchCudaProbe(_Probe):
    """torch.cuda alone: memory always; utilization, power and temperature only where torch
    finds NVML or amdsmi itself."""

    def __init__(self, index: int, kind: str = "cuda"):
        super().__init__()
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no GPU")
        self.torch, self.index, self.kind = torch, index, kind
        self.name = torch.cuda.get_device_name(index)

    def read(self) -> dict[str, Any]:
        cuda, i = self.torch.cuda, self.index
        mem = self._ask("mem", lambda: cuda.mem_get_info(i))
        power = self._ask("power", lambda: cuda.power_draw(i))  # mW
        return {
            "device": self.name,
            "util": _number(self._ask("util", lambda: cuda.utilization(i))),
            "mem_used": int(mem[1] - mem[0]) if mem is not None else None,
            "mem_total": int(mem[1]) if mem is not None else None,
            "power": _number(power / 1000) if power is not None else None,
            "temp": _number(self._ask("temp", lambda: cuda.temperature(i))),
        }


class HostProbe(_Probe):
    """The worker process (CPU %, RSS) and, for CPU workers, the host as the device."""

    def __init__(self, name: str | None = None):
        super().__init__()
        import psutil

        self.process = psutil.Process()
        self.name = name
        self.total = self._ask("total", lambda: psutil.virtual_memory().total)
        self.most = 100.0 * (psutil.cpu_count() or 1)  # no process uses more than every core
        self._since: tuple[float, float] | None = None  # (when, CPU seconds) at the last reading
        self._cpu: float | None = None
        self._ask("cpu", self._cpu_percent)  # the first window starts now

    def read(self) -> dict[str, Any]:
        p = self.process
        with p.oneshot():
            cpu = self._ask("cpu", self._cpu_percent)
            rss = self._ask("rss", lambda: p.memory_info().rss)
        return {"cpu": cpu, "rss": rss}

    def _cpu_percent(self) -> float | None:
        """% of one core since the last reading, over at least CPU_WINDOW: a reading sooner
        than that repeats the last (None within the first), rather than a tick over a tiny
        interval (psutil's ``cpu_percent`` gave 200% on 2 cores for a rank's first sample,
        taken just after the probe was made, and 4,800% for two readings microseconds apart)."""
        now, times = time.monotonic(), self.process.cpu_times()
        used = times.user + times.system
        if self._since is not None and now - self._since[0] < CPU_WINDOW:
            return self._cpu
        if self._since is not None:
            then, before = self._since
            self._cpu = min(100.0 * (used - before) / (now - then), self.most)
        self._since = (now, used)
        return self._cpu


def open_device_probe(
    kind: str, index: int, env: Mapping[str, str] | None = None, root: str | Path = "/"
) -> _Probe | None:
    """The best probe for a GPU of ``kind`` (``"rocm"`` or ``"cuda"``), or None."""
    factories: list[Callable[[], _Probe]] = []
    if kind == "rocm":
        factories = [lambda: AmdSmiProbe(index, env, root), lambda: TorchCudaProbe(index, kind)]
    elif kind == "cuda":
        factories = [lambda: NvmlProbe(index, env), lambda: TorchCudaProbe(index, kind)]
    for make in factories:
        try:
            return make()
        except Exception as e:  # ImportError, a library that cannot start, no matching device
            logger.info("telemetry: %s probe unavailable: %s", kind, e)
    return None
