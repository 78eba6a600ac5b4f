"""The variables Dask's nannies give their workers (``distributed.nanny.pre-spawn-environ``)
reach workers forked from the forkserver, which ``up`` starts before it imports Dask (issue 24:
start-up): from Distributed's defaults at first, and afresh where the user's Dask configuration
changes them. Each test is a script in a process of its own, as a user's would be."""

from __future__ import annotations

import json
import subprocess
import sys

from _forkservers import environ

SCRIPT = """
import json, os, sys

from _forkservers import forkservers

import monarch_nb


NAMES = ("MALLOC_TRIM_THRESHOLD_", "MONARCH_NB_TEST_VARIABLE")
# What the forkserver the worker was forked from started with: what torch and glibc read as
# they load there (a worker's own environment gets Dask's variables again after its fork).
CELL = (
    "import os, psutil\\n"
    f"env = psutil.Process(os.getppid()).environ()\\n[env.get(n) for n in {NAMES}]"
)

if __name__ == "__main__":
    report = {"dask_before_up": "dask" in sys.modules}
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
    try:
        report["seen"] = [list(v) for v in ctl.run(CELL).values()]
        report["parents"] = ctl.call(lambda engine: os.getppid()).values()
        report["serving"] = forkservers()
    finally:
        ctl.down()
    print("REPORT " + json.dumps(report))
"""


def _script(env: dict[str, str]) -> dict:
    env = environ(**env)
    for name in ("OMP_NUM_THREADS", "DASK_CONFIG", "MONARCH_NB_FORKSERVER"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT ") :])


def test_dasks_default_variables_reach_the_one_forkserver():
    report = _script({})
    assert report["dask_before_up"] is False, report  # the forkserver starts before Dask
    assert report["seen"] == [["65536", None]], report  # Distributed's default
    assert report["parents"] == report["serving"], report  # no second forkserver was needed


def test_the_users_dask_configuration_of_them_reaches_the_forkserver():
    """Distributed's defaults are what the forkserver starts with; once ``up`` has imported Dask
    and read the user's configuration, which adds to them, it starts a fresh forkserver."""
    environ = "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"
    report = _script({environ: json.dumps({"MONARCH_NB_TEST_VARIABLE": "from Dask's config"})})
    assert report["dask_before_up"] is False, report
    assert report["seen"] == [["65536", "from Dask's config"]], report
    assert report["parents"] == report["serving"], report
