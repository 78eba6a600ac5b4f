"""``benchmarks/gpu_check.py``, the one call to make on a lent GPU machine, cannot rot between
loans: its dry-run (``--cpu``) runs every part here, through the same code, and each part must
pass, say what it left out, and write the files the GPU run writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.py"
PARTS = ["part 1 kernels tests", "part 2 kernel bench", "part 3a controller", "part 3b notebook 04"]
# what the GPU run writes too; the device tool brings back 8 files at most
FILES = [
    "bench.json",
    "bench.txt",
    "controller.log",
    "kernels-tests.log",
    "notebook-04.ipynb",
    "setup.log",
    "summary.json",
    "summary.txt",
]


def test_the_dry_run_passes_every_part_and_writes_the_gpu_runs_files(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cpu", "--out", out],
        capture_output=True,
        text=True,
        timeout=280,  # under pytest-timeout's 300 s: the parts' own limits end it first
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("gpu check on CPU (dry-run): python ")
    part_lines = [line for line in lines if line.startswith("part ")]
    assert [line.split(":")[0] for line in part_lines] == PARTS
    for line in part_lines:
        assert re.match(r"part \S+ [^:]+: passed in \d+ s; \S", line), line
        assert "(cpu dry-run: " in line, line  # what it leaves out is named, not passed silently
    assert lines[-1].startswith("4 of 4 parts passed in ")
    assert proc.stdout.rstrip().endswith("\n".join(lines[1:]))  # the run's last lines, printed
    assert sorted(p.name for p in out.iterdir()) == FILES

    summary = json.loads((out / "summary.json").read_text())
    by_key = {p["key"]: p for p in summary["parts"]}
    assert by_key["1"]["numbers"]["passed"] >= 1 and by_key["1"]["numbers"]["skipped"] == 1
    bench = json.loads((out / "bench.json").read_text())
    assert bench["complete"] and {r["method"] for r in bench["rows"]} == {
        "dense nn.Linear",
        "bmm pipeline",
        "fused op",
    }
    assert re.search(r"^\|.*\|\s+fused op \|", (out / "bench.txt").read_text(), re.M)
    controller = by_key["3a"]["numbers"]
    assert controller["util"][1] > controller["util"][0] and controller["mem_rise"] > 0
    assert controller["loss"][1] < controller["loss"][0]
    log = (out / "controller.log").read_text()
    assert "monarch-nb: started 1 rank" in log and "cluster shut down" in log
    notebook = json.loads((out / "notebook-04.ipynb").read_text())
    outputs = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert outputs and not any(o["output_type"] == "error" for o in outputs)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--parts", "1,5"], "--parts: unknown 5"),
        (["--budget", "3"], "--budget must be at least 20 s"),
        (["--wheels", "{empty}"], "no wheels in "),
    ],
)
def test_mistakes_are_one_line(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty") for a in args]
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", tmp_path / "out", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # one line saying what was wrong (argparse's usage before it), and nothing run
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not (tmp_path / "out" / "summary.txt").exists()


STOPPED = """
import subprocess, time

def test_quick():
    pass

def test_stuck(tmp_path):
    child = subprocess.Popen(["sleep", "120"])
    open({pid!r}, "w").write(str(child.pid))
    time.sleep(120)
"""


def test_a_part_past_its_limit_is_stopped_with_what_it_started_and_its_tests_counted(tmp_path):
    """What the driver reads when a part's pytest runs past its limit: the tests that finished,
    from its log; the process and the one its test started are gone."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check_parts as parts
    finally:
        sys.path.remove(str(BENCHMARKS))
    pid_file = tmp_path / "pid"
    (tmp_path / "test_stopped.py").write_text(STOPPED.format(pid=str(pid_file)))
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"]
    cmd += ["--rootdir", tmp_path, tmp_path / "test_stopped.py"]
    step = parts.run_step(cmd, log, 6, {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert step.timed_out and "timed out after" in step.failure(log)
    assert parts._log_counts(log) == {"passed": 1, "failed": 0, "errors": 0, "skipped": 0}
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the test's own child outlived the stopped part"
        time.sleep(0.1)
