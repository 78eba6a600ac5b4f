"""PyTorch Monarch's own examples run here with only the module's name changed: ``monarch`` to
``monarch_nb`` where the code names it (its imports, and the one line of getting_started.py that
sets ``monarch.actor.unhandled_fault_hook``). Each runs as ``python script.py``, with its
module-level code and no ``__main__`` guard, and prints what torchmonarch prints.

The examples (tests/monarch_examples/, BSD-licensed, with their licence) are from
meta-pytorch/monarch at commit 3fc0a66e3: the README's example, docs/source/examples/ping_pong.py
and getting_started.py. Of getting_started.py, the sections that need a GPU, the tensor engine
or a scheduler's hosts are left out (SKIPPED). The ``.out`` files are what torchmonarch 0.7.0
printed for the same scripts (the same cut) on the 2-core dev VM: ``python ping_pong.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "monarch_examples"
# getting_started.py's sections (cells between "# %%" lines) left out, by their first line, and
# why: torchmonarch's tensor engine (docs/actors.md says what to use instead) or a scheduler.
SKIPPED = {
    "# Multiple Hosts": "hosts_from_config, a scheduler's hosts",
    "# We obtain the mesh of hosts": "hosts_from_config",
    "# Let's imagine we are writing a trainer": "its procs are the scheduler's hosts'",
    "# Spawn the trainers": "on the scheduler's hosts",
    "# Do one training step": "on the scheduler's hosts",
    "# Actor and Process References": "on the scheduler's hosts (trainer_procs)",
    "# Distributed Tensors": "the tensor engine",
    "# The tensor `t` is now": "the tensor engine (fetch_shard)",
    "# and compute with the tensors": "the tensor engine",
    "# A distributed tensor can be passed": "the tensor engine",
    "# And actors themselves can define": "the tensor engine (rref)",
    "# Actor Context": "on the scheduler's hosts (trainer_procs)",
    "# Free Remote Functions": "the tensor engine (@remote)",
    "# Ports can be passed as arguments": "the tensor engine (activate)",
    "# The port will receive a response": "the answers of the cell above",
}
# Where an actor's output says which actor printed it: stripped, as torchmonarch prints none.
TAG = re.compile(r"^\[\w+ rank \d+\] ")
# getting_started.py's InferenceEngine reads its weights on a thread of its own when a request
# arrives: the first answer may see the weights before or after update_weights(1), in
# torchmonarch as here (its comment promises only the second).
RACY = {"inferred with: 0": "inferred with: 1"}


def monarch_nb_names(source: str) -> str:
    """``source`` with the module ``monarch`` named ``monarch_nb`` wherever code names it."""
    source = re.sub(
        r"^(\s*)from monarch(\.\w+)? import", r"\1from monarch_nb\2 import", source, flags=re.M
    )
    source = re.sub(r"^(\s*)import monarch(\.\w+)", r"\1import monarch_nb\2", source, flags=re.M)
    return re.sub(r"^(\s*)monarch\.(\w+)\.", r"\1monarch_nb.\2.", source, flags=re.M)


def without_skipped(source: str) -> str:
    cells = source.split("\n# %%\n")
    kept = [cell for cell in cells if not cell.lstrip().startswith(tuple(SKIPPED))]
    assert len(cells) - len(kept) == len(SKIPPED), "a skipped section was not found"
    return "\n# %%\n".join(kept)


def run(tmp_path: Path, name: str, source: str) -> list[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout.splitlines()


def same_output(ours: list[str], monarchs: list[str]) -> None:
    """The same lines; the script's own in the same order (actors on several processes print
    in whatever order they run, in torchmonarch too)."""
    ours = [RACY.get(line, line) for line in ours]
    monarchs = [RACY.get(line, line) for line in monarchs]
    assert sorted(TAG.sub("", line) for line in ours) == sorted(monarchs)
    script_lines = [line for line in ours if not TAG.match(line)]
    assert script_lines == [line for line in monarchs if line in script_lines]


@pytest.mark.parametrize("name", ["readme_example", "ping_pong", "getting_started"])
def test_monarchs_example_runs_with_the_name_changed(tmp_path, name):
    source = (EXAMPLES / f"{name}.py").read_text()
    if name == "getting_started":
        source = without_skipped(source)
    changed = monarch_nb_names(source)
    assert "from monarch." not in changed and "import monarch." not in changed
    ours = run(tmp_path, name, changed)
    same_output(ours, (EXAMPLES / f"{name}.out").read_text().splitlines())


def test_only_the_module_name_changes():
    source = (EXAMPLES / "getting_started.py").read_text()
    changed = monarch_nb_names(source)
    differ = [
        (a, b) for a, b in zip(source.splitlines(), changed.splitlines(), strict=True) if a != b
    ]
    assert differ and all(a.replace("monarch", "monarch_nb") == b for a, b in differ)
