"""Device samplers: amdsmi (ROCm), NVML (NVIDIA), torch.cuda (fallback), psutil (every worker).

Every sampler produces the same ``Sample``; a field a library cannot give is ``None``, and a
library that is missing, fails to start or fails on a query degrades to fewer fields, never to
an error. A worker's GPU is ``cuda:<index>`` in torch; which physical device that is depends on
the visibility variables and on the enumeration order, which differ between HIP, CUDA and the
management libraries, so devices are matched by PCI address (or UUID), never by position alone:

- ROCm: the PCI address torch reports for the device, else the KFD topology order (which is
  HIP's) narrowed by ``ROCR_VISIBLE_DEVICES`` and then ``HIP_VISIBLE_DEVICES`` (or
  ``CUDA_VISIBLE_DEVICES``), then the amdsmi handle with that address.
- NVIDIA: the UUID or PCI address torch reports, else the ``CUDA_VISIBLE_DEVICES`` entry (a
  ``GPU-``/``MIG-`` UUID or prefix, or an index, read as NVML's PCI order).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

logger = logging.getLogger(__name__)

DEFAULT_HZ = 2.0
MAX_HZ = 50.0
HZ_ENV = "MONARCH_NB_TELEMETRY_HZ"
FAILURES_BEFORE_GIVING_UP = 3  # consecutive failures of one query before it is no longer asked


class Sample(TypedDict):
    """One reading of one rank. Units: bytes, watts, degrees C; ``util`` and ``cpu`` in %.

    On a CPU worker the "device" is the host: ``mem_used`` is the process's RSS and
    ``mem_total`` the host's memory; ``util``, ``power`` and ``temp`` are None. ``cpu`` is the
    worker process's CPU % (100 = one core busy) and ``rss`` its resident memory, on every kind.
    """

    rank: int | None
    host: str
    time: float
    device: str | None
    kind: str
    util: float | None
    mem_used: int | None
    mem_total: int | None
    power: float | None
    temp: float | None
    cpu: float | None
    rss: int | None


FIELDS = tuple(Sample.__annotations__)
DEVICE_FIELDS = ("device", "util", "mem_used", "mem_total", "power", "temp")


def resolve_hz(hz: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """Sampling rate: ``hz`` if given, else ``$MONARCH_NB_TELEMETRY_HZ``, else 2 Hz; 0 = off.
    A bad ``hz`` is a ValueError; a bad variable is logged and the default used (it is read
    on the workers, where an error would only lose the telemetry)."""
    if hz is not None:
        if hz != hz or hz < 0:
            raise ValueError(f"telemetry rate must be >= 0 Hz, got {hz}")
        return min(float(hz), MAX_HZ)
    text = (os.environ if env is None else env).get(HZ_ENV, "").strip()
    if not text:
        return DEFAULT_HZ
    try:
        return resolve_hz(float(text))
    except ValueError:
        logger.warning("%s=%r is not a rate >= 0; sampling at %g Hz", HZ_ENV, text, DEFAULT_HZ)
        return DEFAULT_HZ


# -- identifying the worker's device ---------------------------------------------------------
Bdf = tuple[int, int, int]  # PCI (domain, bus, device); the function is always 0 for a GPU


def parse_bdf(text: str | bytes | None) -> Bdf | None:
    """``0000:c1:00.0`` (amdsmi, sysfs) or ``00000000:3B:00.0`` (NVML) -> (domain, bus, dev)."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    try:
        domain, bus, rest = text.strip().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def _hex(uuid: Any) -> str:
    """A UUID in any spelling (``GPU-…``, bytes, dashes) as lowercase hex digits only."""
    if isinstance(uuid, bytes):
        uuid = uuid.decode(errors="replace")
    text = str(uuid).lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return "".join(c for c in text if c in "0123456789abcdef")


def _visible(env: Mapping[str, str], name: str) -> list[str] | None:
    value = env.get(name)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def torch_ids(index: int) -> dict[str, Any]:
    """What torch says about ``cuda:<index>``: its ``uuid`` and PCI ``bdf``, when it can."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        props = torch.cuda.get_device_properties(index)
    except Exception:
        return {}
    ids: dict[str, Any] = {}
    uuid = getattr(props, "uuid", None)
    if uuid is not None and _hex(uuid).strip("0"):
        ids["uuid"] = str(uuid)
    if hasattr(props, "pci_bus_id"):
        ids["bdf"] = (
            int(getattr(props, "pci_domain_id", 0)),
            int(props.pci_bus_id),
            int(getattr(props, "pci_device_id", 0)),
        )
    return ids


def kfd_gpus(root: str | Path = "/") -> list[tuple[Bdf, str]]:
    """The GPUs in KFD topology order (ROCr's and so HIP's default order): (bdf, ROCr UUID)."""
    nodes = Path(root) / "sys/class/kfd/kfd/topology/nodes"
    gpus = []
    dirs = [d for d in nodes.glob("*") if d.name.isdigit()] if nodes.is_dir() else []
    for node in sorted(dirs, key=lambda d: int(d.name)):
        try:
            props = dict(
                line.split(None, 1) for line in (node / "properties").read_text().splitlines()
            )
        except (OSError, ValueError):
            continue
        if props.get("simd_count", "0").strip() == "0":
            continue  # a CPU agent
        loc = int(props.get("location_id", "0"))
        # location_id is PCI_DEVID(bus, devfn) = bus << 8 | slot << 3 | function
        bdf = (int(props.get("domain", "0")), loc >> 8, (loc >> 3) & 0x1F)
        gpus.append((bdf, f"GPU-{int(props.get('unique_id', '0')):016x}"))
    return gpus


def _narrow(items: list, spec: list[str] | None, uuid_of: Callable[[Any], str]) -> list:
    """Apply one visibility list (indices or UUIDs) to ``items``; a bad entry ends the list, as
    the runtimes do."""
    if spec is None:
        return items
    out = []
    for entry in spec:
        if entry.isdigit():
            if int(entry) >= len(items):
                break
            out.append(items[int(entry)])
        else:
            match = [it for it in items if _hex(uuid_of(it)).startswith(_hex(entry))]
            if len(match) != 1:
                break
            out.append(match[0])
    return out


def hip_bdf(index: int, env: Mapping[str, str], root: str | Path = "/") -> Bdf | None:
    """The PCI address of HIP device ``index`` in a process with environment ``env``."""
    gpus = _narrow(kfd_gpus(root), _visible(env, "ROCR_VISIBLE_DEVICES"), lambda g: g[1])
    hip = _visible(env, "HIP_VISIBLE_DEVICES")
    if hip is None:
        hip = _visible(env, "CUDA_VISIBLE_DEVICES")
    gpus = _narrow(gpus, hip, lambda g: g[1])
    return gpus[index][0] if index < len(gpus) else None


def cuda_target(index: int, env: Mapping[str, str]) -> tuple[str, Any]:
    """``("uuid", "GPU-…")`` or ``("index", n)``: how ``cuda:<index>`` is named by
    ``CUDA_VISIBLE_DEVICES`` (an index there is read as NVML's PCI order)."""
    visible = _visible(env, "CUDA_VISIBLE_DEVICES")
    if visible is None or index >= len(visible):
        return ("index", index)
    entry = visible[index]
    if entry.isdigit():
        return ("index", int(entry))
    return ("uuid", entry)


# -- probes: each returns a partial sample ---------------------------------------------------
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
                if _hex(nv.nvmlDeviceGetUUID(h)) == _hex(ids["uuid"]):
                    return h
        if "bdf" in ids:
            for h in handles:
                if parse_bdf(nv.nvmlDeviceGetPciInfo(h).busId) == ids["bdf"]:
                    return h
        how, what = cuda_target(index, env)
        if how == "uuid":
            match = [h for h in handles if _hex(nv.nvmlDeviceGetUUID(h)).startswith(_hex(what))]
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
        self.process.cpu_percent(None)  # the first reading is always 0.0: prime it
        self.name = name
        self.total = self._ask("total", lambda: psutil.virtual_memory().total)

    def read(self) -> dict[str, Any]:
        p = self.process
        with p.oneshot():
            cpu = self._ask("cpu", lambda: p.cpu_percent(None))
            rss = self._ask("rss", lambda: p.memory_info().rss)
        return {"cpu": cpu, "rss": rss}


# -- one rank's monitor ----------------------------------------------------------------------
def _device_index(device_info: Mapping[str, Any]) -> int:
    torch_name = str(device_info.get("torch", "cuda:0"))
    _, _, index = torch_name.partition(":")
    return int(index) if index.isdigit() else 0


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


class Monitor:
    """Reads one Sample of a rank: its device probe (if any) plus its process."""

    def __init__(
        self,
        device_info: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        root: str | Path = "/",
    ):
        info = dict(device_info or detect_device())
        self.kind = str(info.get("kind", "cpu"))
        self.host = socket.gethostname()
        self.device = None
        if self.kind != "cpu":
            self.device = open_device_probe(self.kind, _device_index(info), env, root)
        self.process = HostProbe(info.get("name"))
        self.name = getattr(self.device, "name", None) or info.get("name")

    def read(self, rank: int | None) -> Sample:
        sample: dict[str, Any] = dict.fromkeys(FIELDS)
        sample.update(rank=rank, host=self.host, time=time.time(), device=self.name)
        sample["kind"] = self.kind
        if self.device is not None:
            sample.update(self.device.read())
        sample.update(self.process.read())
        if self.kind == "cpu":
            sample["mem_used"], sample["mem_total"] = sample["rss"], self.process.total
        return sample  # type: ignore[return-value]

    def close(self) -> None:
        if self.device is not None:
            self.device.close()


def detect_device() -> dict[str, Any]:
    """Where no engine says what the worker's device is: cuda:0 if torch sees a GPU, else CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return {
                "kind": "rocm" if torch.version.hip else "cuda",
                "torch": "cuda:0",
                "name": torch.cuda.get_device_name(0),
            }
    except Exception:
        pass
    import platform

    return {"kind": "cpu", "torch": "cpu", "name": platform.processor() or platform.machine()}


class Sampler:
    """A daemon thread calling ``sink(read())`` ``hz`` times a second until ``stop()``.

    ``cpu_seconds`` is the CPU time the thread itself has used (``time.thread_time``), which
    is what the overhead budget (1% of a core) is measured against.
    """

    def __init__(self, read: Callable[[], Any], sink: Callable[[Any], None], hz: float):
        self.read, self.sink = read, sink
        self.interval = 1.0 / hz if hz > 0 else None
        self.cpu_seconds = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monarch-telemetry", daemon=True)
        self._failed = False

    def start(self) -> Sampler:
        if self.interval is not None:
            self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        start = time.thread_time()
        due = time.monotonic()
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            try:
                self.sink(self.read())
                self.samples += 1
            except Exception:
                if not self._failed:  # once: a broken sink would otherwise log twice a second
                    logger.exception("telemetry: sampling failed")
                    self._failed = True
            due += self.interval
            now = time.monotonic()
            if due < now:  # fell behind (suspended, overloaded): skip, don't burst
                due = now + self.interval
            self.cpu_seconds = time.thread_time() - start
