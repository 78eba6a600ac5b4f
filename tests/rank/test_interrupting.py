"""An interrupt that finds a rank's thread importing waits for the import to end
(rank/interrupting.py): an import stopped half-way left the rank's packages half-built until a
restart (a later cell's ``fully_shard`` failing on ``torch.distributed.tensor._dtensor_spec``)."""

from __future__ import annotations

import _thread
import sys
import threading

import pytest
from _wait import wait_for

from monarch_nb import CellError
from monarch_nb.rank import interrupting


def test_an_interrupt_lands_after_the_import_it_found_running(clean, tmp_path):
    package = tmp_path / "slowpkg"
    package.mkdir()
    (package / "sub.py").write_text("value = 42\n")
    # A package that imports a submodule, then takes a while: as torch's do
    (package / "__init__.py").write_text("import slowpkg.sub\nimport time\ntime.sleep(1.5)\n")
    clean.run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})")
    try:
        timer = threading.Timer(0.5, _thread.interrupt_main)  # Ctrl-C, mid-import
        timer.start()
        with pytest.raises(CellError) as info:
            clean.run("import slowpkg\nwhile True: pass")
        assert info.value.headline == "interrupted ranks 0-1"
        # the import ran to its end, so the package is whole: stopped in it, it was not
        assert clean.run("import slowpkg\nslowpkg.sub.value").values() == [42, 42]
    finally:
        clean.run(
            "for name in ('slowpkg', 'slowpkg.sub'):\n    sys.modules.pop(name, None)\n"
            f"sys.path.remove({str(tmp_path)!r})"
        )


def test_a_thread_is_seen_importing_only_while_it_does(tmp_path, monkeypatch):
    gate, imported = threading.Event(), threading.Event()
    (tmp_path / "gated_module.py").write_text("import builtins\nbuiltins._gate.wait(10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins._gate", gate, raising=False)

    def imports() -> None:
        import gated_module  # noqa: F401

        imported.set()
        gate.wait(10)  # and stays, outside the import now

    thread = threading.Thread(target=imports, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: interrupting.importing(thread.ident), timeout=10)
        assert not interrupting.importing(threading.get_ident())
    finally:
        gate.set()
    assert imported.wait(10)
    assert not interrupting.importing(thread.ident)
    thread.join(10)
    monkeypatch.delitem(sys.modules, "gated_module")
