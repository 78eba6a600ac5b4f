"""``monarch_nb.up()`` from a script: guarded, it works; at the unguarded top level it stops in
the parent, in one line, before any worker starts (real scripts, run as scripts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

GUARD = 'if __name__ == "__main__":'


def _script(tmp_path, source: str, env: dict[str, str] | None = None, timeout: float = 180):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc, time.monotonic() - start


def test_a_guarded_script_starts_its_cluster(tmp_path):
    proc, _ = _script(
        tmp_path,
        f"""
        import monarch_nb


        def main():
            ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
            print(ctl.pull("rank"))
            ctl.down()


        {GUARD}
            main()
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ValueMesh({0: 0, 1: 1})" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "body",
    [
        "ctl = monarch_nb.up(workers=2, cpu=True)",
        "def main():\n    return monarch_nb.up(workers=2, cpu=True)\n\n\nctl = main()",
    ],
    ids=["top-level", "through-a-function"],
)
def test_an_unguarded_script_stops_in_one_line_before_any_worker(tmp_path, body):
    proc, seconds = _script(
        tmp_path,
        f"import monarch_nb\n\n{body}\nprint('after up')\n\n{GUARD}\n    print('main')\n",
        timeout=60,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "after up" not in proc.stdout
    assert err[-1].startswith("monarch_nb.errors.ClusterError: monarch_nb.up() is called at the ")
    assert "script.py (line " in err[-1] and f"`{GUARD}`" in err[-1]
    # one traceback, no worker ever started, so no nanny's cascade
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert "nanny" not in proc.stderr and "distributed" not in proc.stderr.replace(err[-1], "")
    assert seconds < 30, f"took {seconds:.1f} s"


def test_workers_started_by_fork_do_not_import_the_script(tmp_path):
    """Only spawn and forkserver run the script again, so under fork (Dask's, with our
    forkserver off) an unguarded up() goes on (and here stops at its own argument check,
    starting nothing); with the forkserver on, up's workers come from it, and it is refused."""
    source = "import monarch_nb\n\nmonarch_nb.up(workers=0)\n"
    fork = {"DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD": "fork"}
    proc, _ = _script(tmp_path, source, env={**fork, "MONARCH_NB_FORKSERVER": "0"})
    assert "--workers must be at least 1" in proc.stderr.splitlines()[-1], proc.stderr
    for env in (fork, {}):
        proc, _ = _script(tmp_path, source, env=env)
        assert "ClusterError" in proc.stderr.splitlines()[-1], proc.stderr


def test_a_spawned_process_importing_the_script_starts_nothing(tmp_path):
    """A process started by spawn imports the script as ``__mp_main__``; an ``up()`` at its
    top level there is refused at once instead of starting workers from the child."""
    proc, seconds = _script(
        tmp_path,
        f"""
        import multiprocessing

        import monarch_nb

        OUTCOME = "not reached"
        if __name__ == "__mp_main__":
            try:
                monarch_nb.up(workers=1, cpu=True, dist=False)
                OUTCOME = "started a cluster"
            except monarch_nb.ClusterError as e:
                OUTCOME = f"refused: {{e}}"


        def report(queue):
            queue.put(OUTCOME)


        {GUARD}
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=report, args=(queue,))
            child.start()
            print(queue.get(timeout=60))
            child.join()
        """,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: monarch_nb.up() is called at the top level of "), (
        proc.stdout + proc.stderr
    )
    assert "while a process it started imports it again" in proc.stdout
    assert seconds < 45, f"took {seconds:.1f} s"
