"""A real ipykernel process driven through jupyter_client, as JupyterLab drives one."""

from __future__ import annotations

import os
import queue
import time
import uuid


class KernelProcess:
    """A kernel whose Jupyter runtime directory (and so cluster registry) is ``runtime``; its
    output goes to ``runtime/kernel.log``. Its connection file is named as Jupyter Server
    names it (``kernel-<id>.json``), from which the kernel knows its id."""

    def __init__(self, runtime):
        from jupyter_client import KernelManager

        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
        self.kernel_id = str(uuid.uuid4())
        connection = str(runtime / f"kernel-{self.kernel_id}.json")
        self.km = KernelManager(kernel_name="python3", connection_file=connection)
        self.log = open(runtime / "kernel.log", "a")  # noqa: SIM115 (closed in close)
        self.km.start_kernel(cwd=os.getcwd(), env=env, stdout=self.log, stderr=self.log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def interrupted(self, msg_id: str, timeout: float = 30) -> dict:
        """The reply of ``msg_id``, stopped by the stop button, once its kernel is idle again.

        After an error reply, ipykernel aborts execute requests until its shell thread has
        flushed its queue; a cell sent the moment the reply arrives can be aborted with it.
        Its idle status comes after that flush is queued, as a person's next click does.
        """
        reply = self.kc.get_shell_msg(timeout=timeout)
        assert reply["parent_header"]["msg_id"] == msg_id, reply["parent_header"]
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.01))
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                return reply

    def close(self):
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)
        self.log.close()


class CellKernel(KernelProcess):
    """A kernel whose ``run`` returns every iopub message of a cell."""

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def messages(self, msg_id: str, timeout: float = 120, until=None) -> list[dict]:
        """The iopub messages of ``msg_id`` up to its idle status (or until ``until(msg)``)."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no end of {msg_id} within {timeout} s: {summary(out)}"
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            out.append(msg)
            if until is not None and until(msg):
                return out
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                return out

    def run(self, code: str, timeout: float = 120) -> list[dict]:
        msg_id = self.start(code)
        msgs = self.messages(msg_id, timeout)
        reply = self.kc.get_shell_msg(timeout=10)
        assert reply["content"]["status"] == "ok", (reply["content"], summary(msgs))
        return msgs


def summary(msgs: list[dict]) -> list:
    """The last messages, short: what a failure shows."""
    return [(m["msg_type"], str(m["content"])[:200]) for m in msgs[-30:]]
