"""``python -m monarch_kernels.bench`` prints its table (a small CPU case, quickly)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_prints_every_method_with_ratios_to_dense(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", "--cases", "256:4:64,128:8:32",
         "--no-compile", "--min-time", "0.01", "--calls", "3", "--json", tmp_path / "b.json"],
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
    # --json: the same rows, numbers as numbers
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["device"].startswith("CPU") and report["calls"] == 3 and report["complete"]
    by_method = {(r["n"], r["method"]): r for r in report["rows"]}
    assert len(by_method) == 6 and by_method[256, "dense nn.Linear"]["f+b vs dense"] == 1.0
    for row, rec in zip(rows, report["rows"], strict=True):
        assert rec["fwd ms"] == float(row.split("|")[7]) and "error" not in rec


@pytest.mark.parametrize(
    "args,message",
    [
        (["--calls", "0"], "--calls must be at least 1"),
        (["--paths", "blas,fastest"], "--paths: unknown fastest"),
    ],
)
def test_bench_refuses_bad_arguments(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_kernels.bench", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr
