"""Fixtures of the Jupyter server extension's tests (each module loads pytest_jupyter's
``jupyter_server`` plugin itself)."""

import pytest


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"monarch_nb.server": True}}}


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A private runtime directory (jp_serverapp points JUPYTER_RUNTIME_DIR at its own)."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return tmp_path / "runtime"
