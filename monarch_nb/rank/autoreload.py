"""``%monarch autoreload on``, a rank's side: IPython's own reloader
(``IPython.extensions.autoreload.ModuleReloader``, what ``%autoreload 2`` drives) checked before
each cell, and the modules a cell imported recorded after it, as IPython's post-execute hook
does. A module that fails to reload stops the cell; the error names the module.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import traceback
from typing import Any

from monarch_nb.rank import capture

_failures = threading.local()  # the calling thread's list while it checks, else None


class _Failures(logging.Handler):
    """The exceptions the reloader logs (it prints and logs them, and carries on)."""

    def emit(self, record: logging.LogRecord) -> None:
        got = getattr(_failures, "got", None)
        if got is not None and record.exc_info:
            got.append((record.getMessage(), record.exc_info[1]))


class _Passing:
    """What a reload prints goes on to the cell's output (a module's top level may print),
    except the reloader's own report of a failure: the rank reports that itself, in one line."""

    def __init__(self):
        self.outer = capture.current_capture()
        self.skip_newline = False

    def write(self, cell_id: str, name: str, s: str) -> None:
        if s.startswith("[autoreload of "):
            self.skip_newline = True
            return
        if self.skip_newline and s == "\n":
            self.skip_newline = False
            return
        if self.outer is not None:
            self.outer[0].write(self.outer[1], name, s)

    def emit(self, event: dict[str, Any], urgent: bool = False) -> None:
        pass  # a display while a module reloads has no cell to show in


_FAILED = re.compile(r"module '([^']+)' from file '(.+)'$")  # the reloader's log message
_logger = logging.getLogger("autoreload")
_logger.addHandler(_Failures())


class Reloader:
    def __init__(self):
        from IPython.extensions.autoreload import ModuleReloader

        self.reloader = ModuleReloader()  # records the modules loaded now, as they are
        self.reloader.enabled = True
        self.reloader.check_all = True  # %autoreload 2: every module but the skipped
        self.loaded = set(sys.modules)
        self.broken: dict[str, tuple[str, BaseException]] = {}  # file -> (module, error)

    def before_cell(self) -> dict[str, Any] | None:
        """Reload what changed since the last cell; the error (format_error's shape) of a
        module that failed to reload and is still as it was then, else None. (IPython reports
        such a module once and runs on with its old code; here every cell stops until the
        file changes, so no cell runs on code other than the files say.) Call it inside the
        cell's console: what the modules print as they reload is the cell's output."""
        _failures.got = got = []
        # The rank reports the failure; the worker's log handlers would show it as output.
        _logger.propagate = False
        try:
            with capture.redirect(_Passing()):
                self.reloader.check()
        finally:
            _failures.got = None
            _logger.propagate = True
        for message, exc in got:
            found = _FAILED.search(message)
            if found:
                self.broken[found.group(2)] = (found.group(1), exc)
        failed = self.reloader.failed
        # fixed (reloaded since), or gone: no longer stops cells
        self.broken = {f: v for f, v in self.broken.items() if f in failed and os.path.exists(f)}
        if not self.broken:
            return None
        module, exc = next(iter(self.broken.values()))
        return {
            "ename": "AutoreloadError",
            "evalue": f"autoreload of {module} failed: {type(exc).__name__}: {exc}; the cell "
            "did not run (fix the file and sync it, or %monarch autoreload off)",
            "traceback": _trace(exc),
        }

    def after_cell(self) -> None:
        """Record the modules a cell imported as they are (IPython's post_execute_hook)."""
        new = set(sys.modules) - self.loaded
        for name in new:
            module = sys.modules.get(name)
            _, mtime = self.reloader.filename_and_mtime(module)
            if mtime is not None:
                self.reloader.modules_mtimes[name] = mtime
        self.loaded.update(new)


def _trace(exc: BaseException) -> list[str]:
    """The failed module's own frames (not the reloader's), and where a SyntaxError is."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if "importlib" not in f.filename and "IPython" not in f.filename]
    )
    return "".join(te.format()).rstrip("\n").splitlines()


def enable(engine) -> None:
    """From now on: modules changed after this call reload before the rank's next cell."""
    if engine.reloader is None:
        engine.reloader = Reloader()


def disable(engine) -> None:
    engine.reloader = None
