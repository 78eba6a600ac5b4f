"""A `jupyter lab` of our own on 127.0.0.1 and the headless Chromium that drives it (Debian's
package, through Python playwright; never a downloaded browser). Shared by the browser tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

requires_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"no headless Chromium at {CHROMIUM} (apt-get install chromium; `make test` does)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A `jupyter lab` process of our own on 127.0.0.1, with news and update checks off.

    ``settings`` adds user settings ({plugin id: values}); ``expose_app`` sets
    ``window.jupyterapp`` in the page, so that a test can run JupyterLab's commands."""

    def __init__(self, tmp: Path, settings: dict | None = None, expose_app: bool = False):
        self.port, self.token = free_port(), uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{self.port}"
        self.root, self.runtime = tmp / "notebooks", tmp / "runtime"
        settings_dir = tmp / "settings"
        for d in (self.root, self.runtime):
            d.mkdir(parents=True)
        user_settings = {
            "@jupyterlab/apputils-extension/notification": {
                "fetchNews": "false",
                "checkForUpdates": False,
            },
            # quick polls, so that a scheduler's death shows within seconds
            "monarch-nb/plugin": {"refreshInterval": 500, "maxInterval": 1500},
            **(settings or {}),
        }
        for plugin, values in user_settings.items():
            path = settings_dir / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        config = tmp / "lab_config.json"
        config.write_text(
            json.dumps(
                {
                    "LabApp": {
                        "news_url": None,
                        "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                        "expose_app_in_browser": expose_app,
                    }
                }
            )
        )
        self.log = open(tmp / "lab.log", "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.runtime)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--allow-root",
                "--LabApp.extension_manager=readonly",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}",
                f"--LabApp.user_settings_dir={settings_dir}",
                f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
                f"--config={config}",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = tmp / "lab.log"

    def api(self, path: str, method: str = "GET", body: dict | None = None):
        request = urllib.request.Request(
            f"{self.url}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter lab exited: {self.log_path.read_text()[-3000:]}")
            try:
                self.api("api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        pytest.fail(
            f"jupyter lab did not start in {timeout} s: {self.log_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def chromium():
    """Headless Chromium (Debian's), closed on the way out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


_APPEND_CELL_JS = """([source, run]) => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const index = nb.model.cells.length;
  nb.model.sharedModel.insertCell(index, {cell_type: 'code', source});
  nb.activeCellIndex = index;
  nb.deselectAll();
  if (run) window.jupyterapp.commands.execute('notebook:run-cell');
  return index;
}"""


def append_cell(page, source: str, run: bool = False) -> int:
    """A new code cell at the end of the page's current notebook, selected, and run (without
    waiting) if ``run``; its index. The page is a JupyterLab with ``expose_app``."""
    return page.evaluate(_APPEND_CELL_JS, [source, run])
