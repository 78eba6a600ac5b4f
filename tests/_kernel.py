"""A real ipykernel process driven through jupyter_client, as JupyterLab drives one."""

from __future__ import annotations

import os


class KernelProcess:
    """A kernel whose Jupyter runtime directory (and so cluster registry) is ``runtime``; its
    output goes to ``runtime/kernel.log``."""

    def __init__(self, runtime):
        from jupyter_client import KernelManager

        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
        self.km = KernelManager(kernel_name="python3")
        self.log = open(runtime / "kernel.log", "w")  # noqa: SIM115 (closed in close)
        self.km.start_kernel(cwd=os.getcwd(), env=env, stdout=self.log, stderr=self.log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def close(self):
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)
        self.log.close()
