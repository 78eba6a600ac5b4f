"""``%load_ext monarch_nb`` starts the forkserver, so that ``%monarch up`` finds the workers'
imports done (issue 24: start-up); one no cluster asks for is let go of. Each test is a real
IPython shell in a process of its own, whose children are all it starts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from _forkservers import environ

SCRIPT = """
import json, os, sys, time

from IPython.core.interactiveshell import InteractiveShell

from _forkservers import forkservers

from monarch_nb.controller import forkserver


def wait(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def run(cell):
    result = shell.run_cell(cell)
    result.raise_error()
    return result.result


if __name__ == "__main__":
    forkserver.WARM_FOR = float(sys.argv[1])
    report = {"omp_before": os.environ.get("OMP_NUM_THREADS")}
    shell = InteractiveShell.instance()
    run("%load_ext monarch_nb")
    report["started"] = wait(forkservers, timeout=float(sys.argv[2]))
    report["warm"] = forkservers()
    report["omp_after_load"] = os.environ.get("OMP_NUM_THREADS")
BODY
    print("REPORT " + json.dumps(report))
"""


def _shell(body: str, warm_for: float = 600, wait: float = 30, env=None) -> dict:
    source = SCRIPT.replace("BODY", textwrap.indent(textwrap.dedent(body), "    "))
    env = environ(**(env or {}))
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-c", source, str(warm_for), str(wait)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT ") :])


def test_load_ext_starts_the_forkserver_that_up_forks_from():
    report = _shell(
        """
        run("%monarch up --workers 2 --cpu --no-dist")
        ctl = __import__("monarch_nb").current()
        report["parents"] = ctl.call(lambda engine: os.getppid()).values()
        report["threads"] = ctl.run(
            "import os, torch\\n(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"
        ).values()
        run("%monarch down")
        report["after_down"] = wait(lambda: not forkservers(), timeout=30)
        """
    )
    assert report["started"] and len(report["warm"]) == 1, report
    assert report["parents"] == report["warm"] * 2, report  # the workers came from it
    # with Dask's variables for its workers, though %load_ext ran as Distributed was imported
    assert report["threads"] == [["1", 1]] * 2, report
    assert report["after_down"], report  # and it went with them
    # the notebook's own environment is left alone (the workers' OMP_NUM_THREADS=1 is theirs)
    assert report["omp_before"] is None and report["omp_after_load"] is None, report


def test_a_warm_forkserver_no_cluster_asks_for_is_let_go_of():
    report = _shell(
        """
        report["gone"] = wait(lambda: not forkservers(), timeout=60)
        run("%monarch up --workers 1 --cpu --no-dist")  # up starts one afresh
        report["parents"] = __import__("monarch_nb").current().call(
            lambda engine: os.getppid()
        ).values()
        report["serving"] = forkservers()
        run("%monarch down")
        """,
        warm_for=0.5,
    )
    assert report["started"] and report["gone"], report
    assert report["parents"] == report["serving"] and report["serving"] != report["warm"], report


def test_unloading_the_extension_lets_go_of_it():
    report = _shell(
        """
        run("%unload_ext monarch_nb")
        report["gone"] = wait(lambda: not forkservers(), timeout=60)
        """
    )
    assert report["started"] and report["gone"], report


def test_with_forkserver_up_load_ext_starts_nothing():
    report = _shell(
        """
        run("%monarch up --workers 1 --cpu --no-dist")
        report["parents"] = __import__("monarch_nb").current().call(
            lambda engine: os.getppid()
        ).values()
        report["serving"] = forkservers()
        run("%monarch down")
        """,
        wait=2,
        env={"MONARCH_NB_FORKSERVER": "up"},
    )
    assert not report["started"] and report["warm"] == [], report
    assert report["parents"] == report["serving"] and len(report["serving"]) == 1, report


def test_a_variable_set_after_load_ext_reaches_the_workers():
    """The workers inherit the forkserver's environment: one the user changed since
    ``%load_ext`` is not what a worker would get, so ``up`` starts a fresh forkserver."""
    report = _shell(
        """
        wait(lambda: time.sleep(1) or True)  # the warm forkserver well under way
        os.environ["MONARCH_NB_TEST_VARIABLE"] = "set after %load_ext"
        run("%monarch up --workers 1 --cpu --no-dist")
        ctl = __import__("monarch_nb").current()
        report["seen"] = ctl.call(
            lambda engine: os.environ.get("MONARCH_NB_TEST_VARIABLE")
        ).values()
        report["parents"] = ctl.call(lambda engine: os.getppid()).values()
        run("%monarch down")
        """
    )
    assert report["seen"] == ["set after %load_ext"], report
    assert report["parents"] != report["warm"], report


def test_a_second_cluster_forks_from_the_same_forkserver():
    """The nannies of the first cluster put Dask's variables (OMP_NUM_THREADS=1, ...) in the
    notebook's environment, as the forkserver already had them: no reason to start another."""
    report = _shell(
        """
        import monarch_nb
        run("%monarch up --workers 1 --cpu --no-dist")
        report["omp_after_up"] = os.environ.get("OMP_NUM_THREADS")
        second = monarch_nb.up(workers=1, cpu=True, dist=False, current=False)
        report["parents"] = [
            ctl.call(lambda engine: os.getppid()).values()[0]
            for ctl in (monarch_nb.current(), second)
        ]
        second.down()
        run("%monarch down")
        """
    )
    assert report["omp_after_up"] == "1", report  # Dask's nanny put it there
    assert report["parents"] == report["warm"] * 2, report
