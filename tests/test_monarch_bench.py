"""``python -m monarch_kernels.bench`` prints its table (a small CPU case, quickly)."""

from __future__ import annotations

import subprocess
import sys


def test_bench_prints_every_method_with_ratios_to_dense():
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", "--cases", "256:4:64,128:8:32",
         "--no-compile", "--min-time", "0.01", "--calls", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "3 call(s) back to back" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    methods = {row.split("|")[6].strip() for row in rows}
    assert methods == {"dense nn.Linear", "bmm pipeline", "fused op"}
    assert len(rows) == 6  # two cases x three methods
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        fwd_ms, fb_ms = float(cells[6]), float(cells[10])
        assert fwd_ms > 0 and fb_ms > 0
        assert cells[9].endswith("x") and cells[13].endswith("x")
    dense = [r for r in rows if "dense" in r]
    assert all(r.split("|")[10].strip() == "1.00x" for r in dense)


def test_bench_refuses_zero_calls():
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", "--calls", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--calls must be at least 1" in proc.stderr


def test_bench_refuses_an_unknown_path():
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", "--paths", "blas,fastest"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--paths: unknown fastest" in proc.stderr
