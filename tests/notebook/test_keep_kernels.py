"""A kept cluster (``%monarch up --keep``) across real kernels driven through jupyter_client,
as JupyterLab drives them: a restart, a SIGKILL, a second kernel refused and ``--take``.
The tests share one kept cluster and run in order, handing it from kernel to kernel. (Without
``--keep``, a killed or restarted kernel takes its cluster with it: tests/controller/
test_faults.py counts the processes.)"""

from __future__ import annotations

import os
import signal
import tempfile

import psutil
import pytest
from _kernel import CellKernel
from _wait import running, wait_for

from monarch_nb import kept

NAME = "nb-kept"


class Kernel(CellKernel):
    def restart(self) -> None:
        """The restart button: a graceful shutdown, then a fresh kernel process."""
        self.km.restart_kernel(now=False)
        self.kc.wait_for_ready(timeout=60)

    def ask(self, code: str) -> tuple[str, str]:
        """(the reply's status, everything the cell showed: streams, its value, its error)."""
        msgs = self.messages(self.start(code))
        reply = self.kc.get_shell_msg(timeout=30)
        texts = []
        for m in msgs:
            content = m["content"]
            if m["msg_type"] == "stream":
                texts.append(content["text"])
            elif m["msg_type"] == "execute_result":
                texts.append(content["data"]["text/plain"] + "\n")
            elif m["msg_type"] == "error":
                texts.append("\n".join(content["traceback"]) + "\n")
        return reply["content"]["status"], "".join(texts)

    def said(self, code: str) -> str:
        status, text = self.ask(code)
        assert status == "ok", text
        return text

    def value(self, code: str) -> str:
        return self.said(code).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def shared(runtime):
    """The kernels of the module, by name, and the kept cluster's processes; whatever is left
    at the end is shut down."""
    box: dict = {"kernels": []}

    def kernel() -> Kernel:
        k = Kernel(runtime)
        box["kernels"].append(k)
        k.said("%load_ext monarch_nb")
        return k

    box["kernel"] = kernel
    yield box
    for k in box["kernels"]:
        k.close()
    for entry in kept.entries():
        kept.stop_host(entry)


def processes(entry: dict) -> list[int]:
    host = entry["pid"]
    return [host, *(p.pid for p in psutil.Process(host).children(recursive=True))]


def host_log() -> str:
    """What the hosts said (who attached and let go, when): for a failure's message."""
    return "".join(p.read_text() for p in kept.kept_dir().glob("*.log"))


def detached() -> bool:
    entry = kept.find(NAME)
    return isinstance(entry, dict) and entry["holder"] is None


def test_a_variable_set_before_a_kernel_restart_is_there_after_attach(shared):
    a = shared["a"] = shared["kernel"]()
    out = a.said(f"%monarch up --keep 10m --workers 2 --cpu --name {NAME}")
    assert f"monarch-nb: kept as {NAME}: it outlives this kernel" in out
    a.said("%%monarch\nsecret = rank + 40")
    # a profiled cell's picture too: its folder outlives the kernel, found by the cluster's address
    profiles = tempfile.mkdtemp(prefix="keep-profiles-")
    use = f"import os; os.environ['MONARCH_NB_PROFILE_DIR'] = {profiles!r}"
    a.said(use)
    assert f"traces: {profiles}" in a.said("%%monarch --profile\nimport torch\ntorch.ones(8).sum()")
    shared["processes"] = before = processes(kept.find(NAME))
    a.restart()
    assert wait_for(detached, timeout=30)
    out = a.said("%load_ext monarch_nb\n%monarch attach")
    table, *rest = out.splitlines()
    assert table.split() == ["name", "ranks", "devices", "age", "idle", "held", "by"]
    assert rest[0].startswith(f"{NAME} ") and rest[0].rstrip().endswith("detached")
    assert f"monarch-nb: attached to {NAME}: 2 ranks at tcp://127.0.0.1:" in out
    assert "what the old kernel held itself (ValueMesh results, cell and actor mesh" in out
    assert a.value("%%monarch\nsecret") == "ValueMesh({0: 40, 1: 41})"
    a.said(use)
    out = a.said("%monarch profile --last")
    assert "the whole cell (it took no optimizer step)" in out and f"traces: {profiles}" in out
    assert running(before) == before  # the same processes, none replaced


def test_a_kernel_killed_mid_cell_leaves_its_kept_cluster_running_for_a_new_kernel(shared):
    a = shared["a"]
    b = shared["b"] = shared["kernel"]()  # started first: the attach comes while the cell runs
    pid = int(a.value("import os; print(os.getpid())"))
    cell = a.start("%%monarch\nimport time\nprint('started', flush=True)\ntime.sleep(4)\nlate = 1")
    a.messages(cell, until=lambda m: "started" in m["content"].get("text", ""))
    os.kill(pid, signal.SIGKILL)  # while the ranks run its cell
    assert wait_for(detached, timeout=30), kept.find(NAME)
    before = shared["processes"]
    assert running(before) == before
    out = b.said(f"%monarch attach {NAME}")
    assert f"attached to {NAME}: 2 ranks" in out and "held by" not in out  # named: no list
    assert "still run what the last kernel sent them" in out  # and the attach waited for it
    assert b.value("%%monarch\n(secret, late)") == "ValueMesh({0: (40, 1), 1: (41, 1)})"


def test_a_second_kernel_is_refused_naming_the_first_and_take_detaches_it(shared):
    b, c = shared["b"], shared["kernel"]()
    b_id, c_id = b.kernel_id, c.kernel_id  # as a Jupyter Server names them
    status, out = c.ask(f"%monarch attach {NAME}")
    assert status == "error", (out, host_log())
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [
        f"UsageError: kept cluster {NAME} is attached to kernel {b_id}; "
        f"%monarch attach {NAME} --take detaches it there and attaches here"
    ], lines
    assert b.value("%%monarch\nsecret") == "ValueMesh({0: 40, 1: 41})"  # b still holds it

    assert f"attached to {NAME}: 2 ranks" in c.said(f"%monarch attach {NAME} --take")
    assert b.value("import time, monarch_nb\nwhile monarch_nb.current(): time.sleep(0.1)\n1") == "1"
    status, out = b.ask("%monarch status")
    assert status == "error", out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [
        f"UsageError: kernel {c_id} took kept cluster {NAME} over (%monarch attach --take); "
        f"this kernel is detached from it: %monarch attach {NAME} --take takes it back"
    ]
    status, out = b.ask("%monarch status")  # said once; then as any kernel without a cluster
    assert "no cluster is up" in out

    assert c.value("%%monarch\nsecret") == "ValueMesh({0: 40, 1: 41})"
    before = shared["processes"]
    assert "cluster shut down" in c.said("%monarch down")
    assert wait_for(lambda: not running(before), timeout=60), running(before)
    assert kept.entries() == []
