"""A script with no ``if __name__ == "__main__":`` guard, as PyTorch Monarch's are written, runs
``monarch_nb.up()`` at its top level once: the workers Dask's nanny starts (from the forkserver,
or by spawn) never import it again (controller/main_module.py). Real scripts, run as scripts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import os
import sys
from dataclasses import dataclass

import monarch_nb

with open(sys.argv[1], "a") as f:  # a line per process that runs this file's top level
    f.write(f"{os.getpid()}\\n")
print("pid", os.getpid())


@dataclass
class Seen:
    rank: int
    offset: int


def offset(rank):
    return 10 * rank + 7


def seen(rank):
    return Seen(rank, offset(rank))


ctl = monarch_nb.up(workers=2, cpu=True)
ctl.push({"seen": seen})
ctl.run("s = seen(rank)")
print("pulled", [s == seen(r) for r, s in ctl.pull("s").items()])
print("mapped", ctl.map(offset, range(4)))
ctl.down()
print("down")
"""


@pytest.mark.parametrize("forkserver", ["1", "0"], ids=["forkserver", "spawn"])
def test_an_unguarded_script_runs_its_top_level_once(tmp_path, forkserver):
    """Its top level (a line written to a file) runs in the script's process alone, and the
    ranks run its functions and build its class, which reach them by value."""
    script, once = tmp_path / "script.py", tmp_path / "once.txt"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run(
        [sys.executable, script.name, str(once)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MONARCH_NB_FORKSERVER": forkserver},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert once.read_text().splitlines() == [lines[0].removeprefix("pid ")], proc.stderr
    assert lines[1:] == [
        "pulled [True, True]",
        "mapped [7, 17, 27, 37]",
        "down",
    ], proc.stdout + proc.stderr
