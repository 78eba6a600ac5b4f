"""Which physical GPU a worker's ``cuda:<index>`` is, told apart by PCI address (or UUID).

Which device ``cuda:<index>`` is depends on the visibility variables and on the enumeration
order, which differ between HIP, CUDA and the management libraries, so devices are matched by
PCI address (or UUID), never by position alone:

- ROCm: the PCI address torch reports for the device, else the KFD topology order (which is
  HIP's) narrowed by ``ROCR_VISIBLE_DEVICES`` and then ``HIP_VISIBLE_DEVICES`` (or
  ``CUDA_VISIBLE_DEVICES``), then the amdsmi handle with that address.
- NVIDIA: the UUID or PCI address torch reports, else the ``CUDA_VISIBLE_DEVICES`` entry (a
  ``GPU-``/``MIG-`` UUID or prefix, or an index, read as NVML's PCI order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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


def uuid_hex(uuid: Any) -> str:
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
    if uuid is not None and uuid_hex(uuid).strip("0"):
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
            match = [it for it in items if uuid_hex(uuid_of(it)).startswith(uuid_hex(entry))]
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
