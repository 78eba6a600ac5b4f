"""A KeyboardInterrupt raised in a rank's thread waits for the thread to leave an import.

An import that an exception stops leaves the process half-built for good: Python forgets the
package whose code was running, but keeps the submodules it had imported, and imports the
package afresh next time without putting them back on it as attributes. A Ctrl-C, or another
rank's failure releasing this one, that landed as a cell first imported
``torch.distributed.tensor`` left every later ``fully_shard`` on that rank failing with
``module 'torch.distributed.tensor' has no attribute '_dtensor_spec'`` until a restart. So an
interrupt that finds the thread importing is raised once the import is done, checked every
POLL seconds, or after IMPORT_WAIT seconds all the same (an import that never ends is still
stopped).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

IMPORT_WAIT = 2.0
POLL = 0.005
_IMPORTLIB = "<frozen importlib._bootstrap"  # both of its modules' file names start so


def importing(ident: int) -> bool:
    """Whether the thread ``ident`` is running an import now (its own or one in its call)."""
    frame = sys._current_frames().get(ident)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORTLIB):
            return True
        frame = frame.f_back
    return False


def later(fire: Callable[[bool], bool]) -> None:
    """Call ``fire(force)`` from a thread of its own until it says it is done: ``force`` is
    False until IMPORT_WAIT seconds have passed, then True (fire raises then, or finds it moot)."""

    def poll() -> None:
        deadline = time.monotonic() + IMPORT_WAIT
        while not fire(time.monotonic() >= deadline):
            time.sleep(POLL)

    threading.Thread(target=poll, name="monarch-interrupt-after-import", daemon=True).start()
