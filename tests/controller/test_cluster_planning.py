"""GPU pinning, tested with the files and variables a ROCm or NVIDIA machine presents."""

from pathlib import Path

import pytest

from monarch_nb.controller.cluster import GpuInventory, detect_gpus, load_factory, plan_workers


def fake_rocm(root: Path, gpus: int) -> Path:
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    (nodes / "0").mkdir(parents=True)
    (nodes / "0/properties").write_text("cpu_cores_count 64\nsimd_count 0\n")
    for i in range(1, gpus + 1):
        (nodes / str(i)).mkdir()
        (nodes / f"{i}/properties").write_text("cpu_cores_count 0\nsimd_count 1216\n")
    return root


def fake_nvidia(root: Path, gpus: int) -> Path:
    for i in range(gpus):
        (root / f"proc/driver/nvidia/gpus/0000:{i:02x}:00.0").mkdir(parents=True)
    return root


def test_no_gpu(tmp_path):
    inv = detect_gpus({}, tmp_path)
    assert inv == GpuInventory(None)
    plans = plan_workers(inv)
    assert [p.name for p in plans] == [0, 1]
    assert all(
        "CUDA_VISIBLE_DEVICES" not in p.env and "HIP_VISIBLE_DEVICES" not in p.env for p in plans
    )


def test_rocm_pins_each_worker_with_hip_only(tmp_path):
    inv = detect_gpus({}, fake_rocm(tmp_path, 8))
    assert inv.vendor == "rocm" and len(inv.ids) == 8
    plans = plan_workers(inv)
    assert [p.env["HIP_VISIBLE_DEVICES"] for p in plans] == [str(i) for i in range(8)]
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in plans)


def test_rocm_honours_a_narrowed_variable(tmp_path):
    root = fake_rocm(tmp_path, 8)
    inv = detect_gpus({"HIP_VISIBLE_DEVICES": "2,5"}, root)
    assert inv.ids == ("2", "5")
    assert [p.env["HIP_VISIBLE_DEVICES"] for p in plan_workers(inv)] == ["2", "5"]
    # A ROCm user who narrowed with CUDA_VISIBLE_DEVICES keeps that one variable.
    inv = detect_gpus({"CUDA_VISIBLE_DEVICES": "1,3,4"}, root)
    plans = plan_workers(inv)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["1", "3", "4"]
    assert all("HIP_VISIBLE_DEVICES" not in p.env for p in plans)
    # ROCR_VISIBLE_DEVICES renumbers from 0 for HIP.
    inv = detect_gpus({"ROCR_VISIBLE_DEVICES": "4,6"}, root)
    assert inv.ids == ("0", "1")


def test_nvidia(tmp_path):
    root = fake_nvidia(tmp_path, 4)
    inv = detect_gpus({}, root)
    assert inv.vendor == "cuda"
    plans = plan_workers(inv, workers=2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0", "1"]
    assert all("HIP_VISIBLE_DEVICES" not in p.env for p in plans)
    inv = detect_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}, root)
    assert [p.gpu for p in plan_workers(inv)] == ["GPU-aaaa", "GPU-bbbb"]


def test_cpu_workers_on_a_gpu_machine_hide_the_gpus(tmp_path):
    inv = detect_gpus({}, fake_nvidia(tmp_path, 2))
    plans = plan_workers(inv, workers=3, cpu=True, threads=2)
    assert len(plans) == 3
    assert all(
        p.env["CUDA_VISIBLE_DEVICES"] == "" and p.env["OMP_NUM_THREADS"] == "2" for p in plans
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 3}, "asked for 3 workers but 2 GPUs are visible"),
        (
            {"workers": 4, "mesh": "dp=2,tp=2"},  # not --workers, which the user did not give
            r"^--mesh dp=2,tp=2 asks for 4 workers but 2 GPUs are visible; give a mesh of 2",
        ),
        ({"workers": 0}, "--workers must be at least 1"),
        ({"threads": 0}, "--threads must be at least 1"),
    ],
)
def test_bad_plans(tmp_path, kwargs, message):
    inv = detect_gpus({}, fake_nvidia(tmp_path, 2))
    with pytest.raises(ValueError, match=message):
        plan_workers(inv, **kwargs)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "takes module:factory"),
        ("no_such_module_xyz:f", "cannot import"),
        ("json:nope", "has no attribute 'nope'"),
        ("json:JSONDecoder", "not a distributed cluster"),
        ("json:dumps", "the factory raised TypeError"),
    ],
)
def test_bad_cluster_factories(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        load_factory(spec)
