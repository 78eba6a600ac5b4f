"""Shared fixtures: a real IPython shell and a real local cluster of 2 CPU worker processes."""

from __future__ import annotations

import _thread
import os
import signal
import tempfile
import threading

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# A run started in the background by a shell (`make test &`) inherits SIGINT ignored, which
# Python then leaves as it is: the tests of Ctrl-C need it as a notebook's kernel has it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# `make test` runs the suite in two processes (pytest-xdist): each keeps the clusters it starts,
# and the registry that lists them, in a Jupyter runtime directory of its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="monarch-runtime-")


INTERRUPTS = (_thread.interrupt_main, os.kill, signal.pthread_kill, signal.raise_signal)


@pytest.fixture(autouse=True)
def _sigint_kept():
    """A test leaves SIGINT as it found it: its handler (the Ctrl-C tests after it need
    Python's own), and no Ctrl-C it scheduled (a timer's) left to land in the next test, where
    it would interrupt whatever that test waits on."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    for timer in threading.enumerate():
        if isinstance(timer, threading.Timer) and timer.function in INTERRUPTS:
            timer.cancel()
    if signal.getsignal(signal.SIGINT) is not handler and handler is not None:
        signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """A Jupyter runtime directory of the module's own (its kept clusters, its registry), for
    this process and the kernels and hosts it starts (tests/server has one per test)."""
    path = tmp_path_factory.mktemp("runtime")
    saved = os.environ.get("JUPYTER_RUNTIME_DIR")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(path)
    yield path
    if saved is None:
        del os.environ["JUPYTER_RUNTIME_DIR"]
    else:
        os.environ["JUPYTER_RUNTIME_DIR"] = saved


@pytest.fixture(scope="session")
def ctl():
    """One 2-rank cluster shared by the tests that leave it as they found it."""
    import monarch_nb

    controller = monarch_nb.up(workers=2, cpu=True)
    yield controller
    controller.down()


@pytest.fixture(scope="session")
def ctl4():
    """One 4-rank cluster with the device mesh dp=2,tp=2, for the tests of parallel training."""
    import monarch_nb

    controller = monarch_nb.up(cpu=True, mesh={"dp": 2, "tp": 2}, current=False)
    yield controller
    controller.down()


@pytest.fixture
def mesh4(ctl4):
    """The 4-rank cluster with empty namespaces and its dp=2,tp=2 mesh, made current."""
    from monarch_nb import errors as module

    saved = module.current()
    if ctl4.mesh_shape != {"dp": 2, "tp": 2}:
        ctl4.set_mesh({"dp": 2, "tp": 2})
    ctl4.reset()
    module.set_current(ctl4)
    yield ctl4
    module.set_current(saved)


@pytest.fixture
def clean(ctl):
    """The shared cluster with empty namespaces, made current again."""
    from monarch_nb import errors as module

    module.set_current(ctl)
    ctl.reset()
    yield ctl
    module.set_current(ctl)


@pytest.fixture
def no_current():
    """No current cluster for the test (the shared one is put back after); a cluster the test
    left current is shut down."""
    from monarch_nb import errors as module

    saved = module.current()
    module.set_current(None)
    yield
    ctl = module.current()
    if ctl is not None and ctl is not saved:
        ctl.down()
    module.set_current(saved)


@pytest.fixture(scope="session")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext monarch_nb", store_history=False)
    return sh


class Cell:
    """Run IPython cells and read back what they printed and raised."""

    def __init__(self, shell, capsys):
        self.shell, self.capsys = shell, capsys

    def __call__(self, source: str, expect_error: bool = False):
        self.capsys.readouterr()
        result = self.shell.run_cell(source, store_history=True)
        captured = self.capsys.readouterr()
        self.out, self.err = captured.out, captured.err
        self.error = result.error_in_exec or result.error_before_exec
        if expect_error:
            assert self.error is not None, f"expected an error from {source!r}; printed {self.out}"
        else:
            assert self.error is None, f"{source!r} raised {self.error!r}\n{self.out}\n{self.err}"
        return result.result


@pytest.fixture
def cell(shell, capsys):
    return Cell(shell, capsys)
