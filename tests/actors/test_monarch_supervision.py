"""Supervision, PyTorch Monarch's way, in a script of its own (its cluster is its own, one of its
workers is killed, and the unhandled failure ends in a KeyboardInterrupt in its main thread):
the death of a process under a mesh reaches the owning actor's ``__supervise__`` or, for the
script's own meshes, ``unhandled_fault_hook``; a hook that raises interrupts the main thread."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """\
import os
import time

import monarch_nb.actor
from monarch_nb.actor import Actor, MeshFailure, endpoint, this_host


class Victim(Actor):
    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def fail(self):
        raise ValueError("victim failed")


class Guard(Actor):
    def __init__(self, procs):
        self.victims = procs.spawn("victims", Victim)
        self.seen = []

    def __supervise__(self, failure: MeshFailure):
        self.seen.append(str(failure))
        return True

    @endpoint
    def victim_pids(self):
        return list(self.victims.pid.call().get().values())

    @endpoint
    def failures(self):
        return list(self.seen)


def wait(what):
    deadline = time.monotonic() + 30
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)
    return what()


heard = []
monarch_nb.actor.unhandled_fault_hook = heard.append
procs = this_host().spawn_procs(per_host={"gpus": 3})
guard = procs.slice(gpus=0).spawn("guard", Guard, procs.slice(gpus=slice(1, 3)))
direct = procs.slice(gpus=slice(1, 3)).spawn("direct", Victim)
pids = guard.victim_pids.call_one().get()
os.kill(pids[1], 9)  # rank 2's worker: under the guard's mesh and under the script's own
print("guard:", wait(lambda: guard.failures.call_one().get())[0])
wait(lambda: heard)
print("hook:", [(f.mesh_name, f.rank) for f in heard], "is dead:" in str(heard[0]))


def unhandled(failure):
    raise SystemExit(1)


monarch_nb.actor.unhandled_fault_hook = unhandled
try:
    direct.slice(gpus=0).fail.broadcast()
    time.sleep(30)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted by the unhandled failure")
"""


def test_a_dead_process_and_an_unhandled_failure(tmp_path):
    script = tmp_path / "supervised.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("guard: actor mesh 'victims' rank 2 is dead: "), done.stdout
    assert lines[1] == "hook: [('direct', 2)] True", done.stdout
    assert lines[2] == "interrupted by the unhandled failure", done.stdout
    assert (
        "monarch_nb: unhandled failure (SystemExit from unhandled_fault_hook): broadcast to "
        "Victim.fail failed on rank 1: ValueError: victim failed"
    ) in done.stderr
