"""Device samplers: the one schema on real CPU workers, and the ROCm (amdsmi) and NVIDIA (NVML)
paths with stand-ins for those libraries injected at the import boundary."""

from __future__ import annotations

import itertools
import sys
import threading
import time
import types

import pytest

from monarch_nb.telemetry import devices, probes
from monarch_nb.telemetry import samplers as telemetry
from monarch_nb.telemetry.samplers import FIELDS

GIB = 2**30


def check_schema(sample, rank, kind):
    assert tuple(sample) == FIELDS
    assert sample["rank"] == rank and sample["kind"] == kind
    assert sample["host"] and abs(sample["time"] - time.time()) < 60
    for key in ("util", "power", "temp", "cpu"):
        assert sample[key] is None or isinstance(sample[key], float), key
    for key in ("mem_used", "mem_total", "rss"):
        assert sample[key] is None or isinstance(sample[key], int), key


# -- CPU workers, real cluster -----------------------------------------------------------------
def test_cpu_schema_on_every_worker(ctl):
    def read(engine):
        from monarch_nb.telemetry.samplers import Monitor

        monitor = Monitor(engine.device_info)
        monitor.read(engine.identity["rank"])
        time.sleep(0.2)  # the process CPU % is measured between two readings
        return monitor.read(engine.identity["rank"])

    for rank, sample in ctl.call(read).items():
        check_schema(sample, rank, "cpu")
        assert sample["device"]
        assert sample["rss"] > 10 * 2**20 and sample["mem_used"] == sample["rss"]
        assert sample["mem_total"] > sample["rss"]
        assert sample["cpu"] is not None and sample["cpu"] >= 0
        assert sample["util"] is None and sample["power"] is None and sample["temp"] is None


def test_sampler_thread_rate_and_cpu_time():
    monitor = telemetry.Monitor({"kind": "cpu", "torch": "cpu", "name": "test cpu"})
    got = []
    sampler = telemetry.Sampler(lambda: monitor.read(3), got.append, hz=20).start()
    time.sleep(0.6)
    sampler.stop()
    assert not sampler.alive
    assert 5 <= len(got) <= 14  # 20 Hz for 0.6 s, with slack for a loaded machine
    check_schema(got[-1], 3, "cpu")
    assert 0 < sampler.cpu_seconds < 0.6


def test_zero_hz_starts_no_thread():
    sampler = telemetry.Sampler(lambda: 1, lambda s: None, hz=0).start()
    assert not sampler.alive


def test_sampler_reads_at_its_rate_only_while_busy():
    """Idle: one reading each ``idle_every`` (the first at once); busy: ``hz`` a second, from
    the first interval on. ``None`` (nothing to read yet) is not a reading."""
    busy = threading.Event()
    got, asked = [], []

    def read():
        asked.append(time.monotonic())
        return None if len(asked) == 1 else len(asked)

    sampler = telemetry.Sampler(read, got.append, hz=20, busy=busy.is_set, idle_every=0.5)
    sampler.start()
    try:
        time.sleep(1.2)
        idle = len(got)
        busy.set()
        time.sleep(0.6)
        during = len(got) - idle
        busy.clear()
        time.sleep(0.2)
        marked = len(got)
        time.sleep(0.6)
        after = len(got) - marked
    finally:
        sampler.stop()
    assert asked[1] - asked[0] < 0.2  # the None was not counted: asked again next interval
    assert 2 <= idle <= 4, idle  # at ~0.05 s, then ~0.55 and ~1.05
    assert during >= 6, during  # 20 Hz for 0.6 s, with slack for a loaded machine
    assert after <= 2, after


def test_rate_from_parameter_and_environment():
    assert telemetry.resolve_hz(env={}) == 2.0
    assert telemetry.resolve_hz(env={"MONARCH_NB_TELEMETRY_HZ": "5"}) == 5.0
    assert telemetry.resolve_hz(1.0, env={"MONARCH_NB_TELEMETRY_HZ": "5"}) == 1.0
    assert telemetry.resolve_hz(env={"MONARCH_NB_TELEMETRY_HZ": "fast"}) == 2.0
    assert telemetry.resolve_hz(env={"MONARCH_NB_TELEMETRY_HZ": "-3"}) == 2.0
    assert telemetry.resolve_hz(env={"MONARCH_NB_TELEMETRY_HZ": "0"}) == 0.0
    assert telemetry.resolve_hz(1000) == telemetry.MAX_HZ
    with pytest.raises(ValueError, match=">= 0"):
        telemetry.resolve_hz(-1)


# -- NVIDIA: a stand-in for pynvml ---------------------------------------------------------------
class NVMLError(Exception):
    pass


def fake_pynvml(devices, broken=()):
    """A pynvml module over ``devices`` (dicts in NVML's order); queries in ``broken`` raise."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU = 0
    nv.calls = {"init": 0, "shutdown": 0}

    def query(key, fn):
        def call(h, *args):
            if key in broken:
                raise NVMLError(f"{key} not supported")
            return fn(devices[h], *args)

        return call

    nv.nvmlInit = lambda: nv.calls.__setitem__("init", nv.calls["init"] + 1)
    nv.nvmlShutdown = lambda: nv.calls.__setitem__("shutdown", nv.calls["shutdown"] + 1)
    nv.nvmlDeviceGetCount = lambda: len(devices)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUUID = query("uuid", lambda d: d["uuid"])
    nv.nvmlDeviceGetName = query("name", lambda d: d["name"].encode())
    nv.nvmlDeviceGetPciInfo = query("pci", lambda d: types.SimpleNamespace(busId=d["bus"]))
    nv.nvmlDeviceGetUtilizationRates = query(
        "util", lambda d: types.SimpleNamespace(gpu=d["util"], memory=1)
    )
    nv.nvmlDeviceGetMemoryInfo = query(
        "mem", lambda d: types.SimpleNamespace(used=d["used"], total=80 * GIB, free=0)
    )
    nv.nvmlDeviceGetPowerUsage = query("power", lambda d: d["mw"])
    nv.nvmlDeviceGetTemperature = query("temp", lambda d, sensor: d["temp"])
    return nv


NV_DEVICES = [
    {
        "uuid": f"GPU-{c * 8}-1111-2222-3333-444455556666",
        "name": f"NVIDIA H100 #{i}",
        "bus": f"00000000:{0x18 + 0x20 * i:02X}:00.0",
        "util": 10 * (i + 1),
        "used": (i + 1) * GIB,
        "mw": 100_000 + 1000 * i,
        "temp": 40 + i,
    }
    for i, c in enumerate("abcd")
]


@pytest.fixture
def no_torch_gpu(monkeypatch):
    """torch sees no GPU (true here; made explicit so the env mapping is what counts)."""

    def no_gpu(*args):
        raise RuntimeError("torch sees no GPU")

    monkeypatch.setattr(probes, "torch_ids", lambda index: {})
    monkeypatch.setattr(probes, "TorchCudaProbe", no_gpu)


@pytest.mark.parametrize(
    ("visible", "index", "expect"),
    [
        (None, 0, 0),  # nothing pinned: cuda:0 is NVML's first
        (None, 2, 2),
        ("2", 0, 2),  # pinned by index: the worker's device 0 is GPU 2
        ("3,1", 1, 1),
        ("GPU-cccccccc-1111-2222-3333-444455556666", 0, 2),  # pinned by UUID
        ("GPU-dddd", 0, 3),  # a unique UUID prefix is enough, as for CUDA itself
        ("GPU-bbbbbbbb-1111-2222-3333-444455556666,GPU-aaaa", 1, 0),
    ],
)
def test_nvml_maps_the_workers_device(monkeypatch, no_torch_gpu, visible, index, expect):
    nv = fake_pynvml(NV_DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    probe = probes.NvmlProbe(index, env)
    assert probe.handle == expect
    got = probe.read()
    d = NV_DEVICES[expect]
    assert got == {
        "device": d["name"],
        "util": float(d["util"]),
        "mem_used": d["used"],
        "mem_total": 80 * GIB,
        "power": d["mw"] / 1000,
        "temp": float(d["temp"]),
    }
    probe.close()
    assert nv.calls == {"init": 1, "shutdown": 1}


def test_nvml_prefers_the_pci_address_torch_reports(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NV_DEVICES))
    # CUDA's default order (fastest first) can differ from NVML's: torch's PCI address decides.
    monkeypatch.setattr(probes, "torch_ids", lambda index: {"bdf": (0, 0x58, 0)})
    probe = probes.NvmlProbe(0, {"CUDA_VISIBLE_DEVICES": "0"})
    assert probe.handle == 2
    monkeypatch.setattr(
        probes, "torch_ids", lambda index: {"uuid": "dddddddd-1111-2222-3333-444455556666"}
    )
    assert probes.NvmlProbe(0, {}).handle == 3


def test_nvml_unsupported_queries_become_none(monkeypatch, no_torch_gpu):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NV_DEVICES, broken={"power", "temp"}))
    probe = probes.NvmlProbe(0, {})
    for _ in range(probes.FAILURES_BEFORE_GIVING_UP + 1):
        got = probe.read()
    assert got["power"] is None and got["temp"] is None
    assert got["util"] == 10.0 and got["mem_used"] == GIB
    assert probe._failures["power"] == probes.FAILURES_BEFORE_GIVING_UP  # no longer asked


def test_nvml_no_such_device_falls_back_without_error(monkeypatch, no_torch_gpu):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NV_DEVICES))
    with pytest.raises(LookupError, match="GPU-ffff"):
        probes.NvmlProbe(0, {"CUDA_VISIBLE_DEVICES": "GPU-ffff"})
    # torch on this machine has no GPU either: the sample has no device fields, but no error.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    monitor = telemetry.Monitor({"kind": "cuda", "torch": "cuda:0", "name": "H100"})
    assert monitor.device is None
    sample = monitor.read(0)
    check_schema(sample, 0, "cuda")
    assert sample["device"] == "H100" and sample["util"] is None and sample["mem_used"] is None
    assert sample["rss"] > 0


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_missing_library_degrades_to_fewer_fields(monkeypatch, no_torch_gpu, kind):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monitor = telemetry.Monitor({"kind": kind, "torch": "cuda:0", "name": "gpu"})
    time.sleep(probes.CPU_WINDOW)  # a CPU reading spans at least this much
    sample = monitor.read(1)
    check_schema(sample, 1, kind)
    assert [sample[k] for k in ("util", "mem_used", "power", "temp")] == [None] * 4
    assert sample["cpu"] is not None and sample["rss"] > 0


def test_nvml_through_the_monitor(monkeypatch, no_torch_gpu):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NV_DEVICES))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monitor = telemetry.Monitor({"kind": "cuda", "torch": "cuda:0", "name": "from torch"})
    sample = monitor.read(4)
    check_schema(sample, 4, "cuda")
    assert sample["device"] == "NVIDIA H100 #1" and sample["util"] == 20.0
    assert sample["power"] == 101.0 and sample["mem_total"] == 80 * GIB


# -- ROCm: a stand-in for amdsmi and a KFD topology ----------------------------------------------
# Four GPUs. KFD (= HIP) order is by node number; amdsmi lists them in another order.
KFD = [  # (node, bus, unique_id)
    (2, 0xC1, 0x1111),
    (3, 0x41, 0x2222),
    (4, 0x81, 0x3333),
    (5, 0x01, 0x4444),
]
AMD_ORDER = [0x01, 0x41, 0x81, 0xC1]  # amdsmi's handles, by bus


def kfd_root(tmp_path):
    nodes = tmp_path / "sys/class/kfd/kfd/topology/nodes"
    for node, simd in ((0, 0), (1, 0)):  # CPU agents
        (nodes / str(node)).mkdir(parents=True)
        (nodes / str(node) / "properties").write_text(f"simd_count {simd}\nlocation_id 0\n")
    for node, bus, uid in KFD:
        (nodes / str(node)).mkdir(parents=True)
        (nodes / str(node) / "properties").write_text(
            f"cpu_cores_count 0\nsimd_count 304\nlocation_id {bus << 8}\n"
            f"domain 0\nunique_id {uid}\n"
        )
    return tmp_path


def fake_amdsmi(memory_api=True, power=None):
    smi = types.ModuleType("amdsmi")
    smi.calls = {"init": 0, "shutdown": 0}
    smi.AmdSmiMemoryType = types.SimpleNamespace(VRAM="vram")
    smi.AmdSmiTemperatureType = types.SimpleNamespace(EDGE="edge", HOTSPOT="hotspot")
    smi.AmdSmiTemperatureMetric = types.SimpleNamespace(CURRENT="current")
    smi.amdsmi_init = lambda *a: smi.calls.__setitem__("init", smi.calls["init"] + 1)
    smi.amdsmi_shut_down = lambda: smi.calls.__setitem__("shutdown", smi.calls["shutdown"] + 1)
    smi.amdsmi_get_processor_handles = lambda: [f"h{bus:02x}" for bus in AMD_ORDER]

    def bus(h):
        return int(h[1:], 16)

    smi.amdsmi_get_gpu_device_bdf = lambda h: f"0000:{bus(h):02x}:00.0"
    smi.amdsmi_get_gpu_asic_info = lambda h: {"market_name": f"MI300X@{bus(h):02x}"}
    smi.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": bus(h) % 100, "umc_activity": 0}

    if memory_api:
        smi.amdsmi_get_gpu_memory_usage = lambda h, t: bus(h) * 2**20
        smi.amdsmi_get_gpu_memory_total = lambda h, t: 192 * GIB

    smi.amdsmi_get_gpu_vram_usage = lambda h: {"vram_used": bus(h), "vram_total": 192 * 1024}
    smi.amdsmi_get_power_info = lambda h: (
        power
        or {
            "current_socket_power": 300 + bus(h),
            "average_socket_power": "N/A",
        }
    )

    def temp(h, sensor, metric):
        if sensor == "edge":  # MI300 has no edge sensor
            return "N/A"
        return 50 + bus(h) % 10

    smi.amdsmi_get_temp_metric = temp
    return smi


@pytest.mark.parametrize(
    ("env", "index", "bus"),
    [
        ({}, 0, 0xC1),  # nothing pinned: HIP device 0 is KFD's first GPU, amdsmi's last
        ({}, 3, 0x01),
        ({"HIP_VISIBLE_DEVICES": "2"}, 0, 0x81),  # pinned: the worker's device 0 is HIP 2
        ({"CUDA_VISIBLE_DEVICES": "1"}, 0, 0x41),  # HIP honours CUDA_VISIBLE_DEVICES too
        ({"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "0"}, 0, 0x01),  # HIP's wins
        ({"ROCR_VISIBLE_DEVICES": "1,3"}, 1, 0x01),
        ({"ROCR_VISIBLE_DEVICES": "1,3", "HIP_VISIBLE_DEVICES": "1"}, 0, 0x01),  # HIP into ROCR
        ({"ROCR_VISIBLE_DEVICES": "GPU-0000000000003333"}, 0, 0x81),  # a ROCr UUID
    ],
)
def test_amdsmi_maps_hip_order_by_pci_address(monkeypatch, tmp_path, no_torch_gpu, env, index, bus):
    smi = fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    probe = probes.AmdSmiProbe(index, env, root=kfd_root(tmp_path))
    assert probe.handle == f"h{bus:02x}"
    assert probe.read() == {
        "device": f"MI300X@{bus:02x}",
        "util": float(bus % 100),
        "mem_used": bus * 2**20,
        "mem_total": 192 * GIB,
        "power": float(300 + bus),
        "temp": float(50 + bus % 10),  # the hotspot sensor, as edge says N/A
    }
    probe.close()
    assert smi.calls == {"init": 1, "shutdown": 1}


def test_amdsmi_prefers_the_pci_address_torch_reports(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    monkeypatch.setattr(probes, "torch_ids", lambda index: {"bdf": (0, 0x41, 0)})
    probe = probes.AmdSmiProbe(0, {"HIP_VISIBLE_DEVICES": "0"}, root=kfd_root(tmp_path))
    assert probe.handle == "h41"


def test_amdsmi_older_api_and_missing_readings(monkeypatch, tmp_path, no_torch_gpu):
    power = {"current_socket_power": "N/A", "average_socket_power": 250}
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(memory_api=False, power=power))
    got = probes.AmdSmiProbe(0, {}, root=kfd_root(tmp_path)).read()
    assert got["mem_used"] == 0xC1 * 2**20  # vram_usage is in MB
    assert got["mem_total"] == 192 * GIB
    assert got["power"] == 250.0


def test_amdsmi_unknown_device_or_broken_library_degrades(monkeypatch, tmp_path, no_torch_gpu):
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    with pytest.raises(LookupError):
        probes.AmdSmiProbe(0, {"HIP_VISIBLE_DEVICES": "7"}, root=kfd_root(tmp_path))
    broken = fake_amdsmi()

    def fail(*a):
        raise RuntimeError("amdsmi_init: driver not loaded")

    broken.amdsmi_init = fail
    monkeypatch.setitem(sys.modules, "amdsmi", broken)
    monitor = telemetry.Monitor({"kind": "rocm", "torch": "cuda:0", "name": "MI300X"})
    sample = monitor.read(0)
    check_schema(sample, 0, "rocm")
    assert sample["device"] == "MI300X" and sample["util"] is None


def test_pci_address_spellings():
    assert devices.parse_bdf("0000:c1:00.0") == (0, 0xC1, 0)
    assert devices.parse_bdf(b"00000000:3B:00.0") == (0, 0x3B, 0)
    assert devices.parse_bdf("0001:02:1f.0") == (1, 2, 0x1F)
    assert devices.parse_bdf("N/A") is None
    assert devices.kfd_gpus("/nonexistent") == []


def test_host_cpu_is_read_over_a_window_never_a_tick():
    """Readings microseconds apart once gave a 4,800% sample, and a rank's first one, just after
    the probe was made, 200% on 2 cores (a process's CPU time counts 10 ms ticks, divided by the
    tiny wall time between two readings): a reading spans at least CPU_WINDOW, one sooner
    repeats the last, and those within the first window are None (not measured yet)."""
    import psutil

    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    spinner.start()
    try:
        made = time.monotonic()
        probe = probes.HostProbe()
        readings = []  # (when it was asked, what it said)
        while time.monotonic() - made < 3.5 * probes.CPU_WINDOW:
            readings.append((time.monotonic(), probe.read()["cpu"]))
    finally:
        stop.set()
        spinner.join()
    window = probes.CPU_WINDOW
    assert readings[0][1] is None
    assert all(cpu is None for when, cpu in readings if when < made + window), readings[:5]
    pairs = list(itertools.pairwise(readings))
    changed = [when for (_, last), (when, cpu) in pairs if cpu != last]
    assert len(changed) >= 2, readings[-5:]  # 3.5 windows: a first value, then others
    gaps = [b - a for a, b in itertools.pairwise(changed)]
    assert all(gap > 0.9 * window for gap in gaps), gaps
    values = {cpu for _, cpu in readings if cpu is not None}
    assert all(0 < cpu <= 100.0 * psutil.cpu_count() for cpu in values), values
