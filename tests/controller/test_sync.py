"""``%monarch sync`` and ``%monarch autoreload`` on the shared 2-rank cluster of worker
processes, through a real IPython shell: the edit-run loop without a restart, deletions, a
module that fails to reload, and the bad inputs, each refused in one line with nothing sent."""

from __future__ import annotations

import os
import re
import sys
import uuid

import pytest
from IPython.core.error import UsageError

import monarch_nb
from monarch_nb.controller import sync as code_sync
from monarch_nb.rank import sync as rank_sync


def _package(root, body: str = "def f():\n    return 1\n") -> tuple[str, str]:
    """A package with a unique name (a rank's sys.modules outlives a test): (name, path)."""
    name = f"pkg_{uuid.uuid4().hex[:8]}"
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(body)
    (pkg / "data").mkdir()
    (pkg / "data" / "table.csv").write_text("a,b\n1,2\n")
    return name, str(pkg)


@pytest.fixture
def reloading(clean):
    yield clean
    clean.autoreload(False)


def test_edit_sync_and_autoreload_without_a_restart(reloading, cell, tmp_path):
    name, pkg = _package(tmp_path)
    cell(f"%monarch sync {pkg}")
    assert cell.out.strip() == "monarch-nb: sync: sent 3 files (30 B) to ranks 0-1"
    cell("%monarch autoreload on")
    assert "autoreload on" in cell.out
    first = cell(f"%%monarch\nimport os, {name}.model\n(os.getpid(), {name}.model.f())")
    assert [v for _, v in first.values()] == [1, 1]

    # The same size as before, rewritten within the second the bytecode was cached in.
    (tmp_path / name / "model.py").write_text("def f():\n    return 2\n")
    cell(f"%monarch sync {pkg}")
    assert cell.out.strip() == "monarch-nb: sync: sent 1 file (22 B) to ranks 0-1"
    again = cell(f"%%monarch\n(os.getpid(), {name}.model.f())")
    assert again.values() == [(pid, 2) for pid, _ in first.values()]  # same processes

    cell(f"%monarch sync {pkg}")
    assert cell.out.strip() == (
        "monarch-nb: sync: ranks 0-1 already had all 3 files (30 B); nothing sent"
    )

    # Off: a change reaches the files on the ranks, not the module already imported.
    cell("%monarch autoreload off")
    (tmp_path / name / "model.py").write_text("def f():\n    return 3\n")
    cell(f"%monarch sync {pkg}")
    assert cell(f"%%monarch\n{name}.model.f()").values() == [2, 2]


def test_files_deleted_here_are_deleted_on_the_ranks(clean, tmp_path):
    name, pkg = _package(tmp_path)
    (tmp_path / name / "extra.py").write_text("X = 1\n")
    assert clean.sync(pkg).files == 4
    clean.run(f"import {name}.extra")
    (tmp_path / name / "extra.py").unlink()
    (tmp_path / name / "data" / "table.csv").unlink()
    report = clean.sync(pkg)
    assert (report.files, report.deleted) == (0, 2)
    assert str(report) == "deleted 2 files on ranks 0-1"
    listing = clean.run(
        f"import os, {name}\nroot = os.path.dirname({name}.__file__)\n"
        "sorted(f for f in os.listdir(root) if f != '__pycache__')"
    )
    assert listing.values() == [["__init__.py", "model.py"]] * 2  # the emptied folder went too


def test_a_single_file_and_one_rank(clean, tmp_path):
    name = f"mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("VALUE = 'here'\n")
    report = clean.sync(tmp_path / f"{name}.py", targets=[1])
    assert (report.ranks, report.files) == ([1], 1)
    assert clean.run(f"import {name}; {name}.VALUE", targets=[1]).values() == ["here"]
    found = clean.run(f"import importlib.util; importlib.util.find_spec({name!r}) is None")
    assert found.values() == [True, False]


def test_a_module_that_fails_to_reload_stops_the_cell(reloading, cell, tmp_path):
    name, pkg = _package(tmp_path)
    cell(f"%monarch sync {pkg}")
    cell("%monarch autoreload on")
    cell(f"%%monarch\nimport {name}.model")
    (tmp_path / name / "model.py").write_text("def f(:\n    return 2\n")
    cell(f"%monarch sync {pkg}")
    cell("%%monarch\nprint('ran')\nran = True", expect_error=True)
    err = cell.error
    assert isinstance(err, monarch_nb.CellError)
    assert sorted(err.errors) == [0, 1]
    assert {e.ename for e in err.errors.values()} == {"AutoreloadError"}
    said = rf"\[ranks? 0(-1)?\] AutoreloadError: autoreload of {name}.model failed: SyntaxError"
    assert re.search(said, cell.out), cell.out
    assert "the cell did not run" in cell.out and "] ran" not in cell.out
    assert "[autoreload of" not in cell.out + cell.err  # the reloader's own report: not shown
    with pytest.raises(NameError, match="ran is not defined"):
        reloading.pull("ran")
    # Still broken: the next cell does not run on the old code either.
    cell("%%monarch\nran = True", expect_error=True)
    assert "autoreload of" in cell.out
    with pytest.raises(NameError, match="ran is not defined"):
        reloading.pull("ran")

    (tmp_path / name / "model.py").write_text("def f():\n    return 5\n")
    cell(f"%monarch sync {pkg}")
    assert cell(f"%%monarch\n{name}.model.f()").values() == [5, 5]


def test_autoreload_comes_back_on_a_restarted_rank_as_the_cells_ask_for_it(reloading, tmp_path):
    """A rank whose engine has no reloader (a fresh worker) makes one at the cell that asks."""
    name, pkg = _package(tmp_path)
    reloading.sync(pkg)
    reloading.autoreload(True)
    reloading.call(lambda engine: setattr(engine, "reloader", None), targets=[1])
    reloading.run(f"import {name}.model")
    (tmp_path / name / "model.py").write_text("def f():\n    return 7\n")
    reloading.sync(pkg)
    assert reloading.run(f"{name}.model.f()").values() == [7, 7]


def _held(ctl) -> dict:
    return ctl.call(lambda engine: {k: dict(v) for k, v in rank_sync._manifests.items()}).values()


BAD = [
    ("missing", lambda t: f"%monarch sync {t}/nope", "sync: '{t}/nope' does not exist"),
    ("autoreload", lambda t: "%monarch autoreload maybe", "invalid choice: 'maybe'"),
    (
        "loop",
        lambda t: f"%monarch sync {t}/looped",
        "sync: '{t}/looped/inner/back' is a symlink loop",
    ),
    ("self-link", lambda t: f"%monarch sync {t}/self", "sync: '{t}/self' is a symlink loop"),
    (
        "too-large",
        lambda t: f"%monarch sync {t}/big",
        "hold 210.8 MB in 2 files, more than the 200.0 MB limit",
    ),
    ("same-name", lambda t: f"%monarch sync {t}/big {t}/looped/big", "would both land as 'big'"),
]


@pytest.mark.parametrize(("case", "line", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_sends_nothing(clean, cell, tmp_path, case, line, text):
    (tmp_path / "looped" / "inner").mkdir(parents=True)
    os.symlink(tmp_path / "looped", tmp_path / "looped" / "inner" / "back")
    (tmp_path / "looped" / "big").mkdir()
    os.symlink(tmp_path / "self", tmp_path / "self")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "small.py").write_text("x = 1\n")
    with open(tmp_path / "big" / "weights.bin", "wb") as f:
        f.truncate(210_800_000)  # sparse: refused by its size, never read
    before = _held(clean)
    cell(line(tmp_path), expect_error=True)
    assert isinstance(cell.error, UsageError)
    message = str(cell.error)
    assert "\n" not in message
    assert text.format(t=tmp_path) in message
    assert _held(clean) == before
    assert clean.run("rank").values() == [0, 1]


def test_the_size_limit_is_stated_and_can_be_raised(monkeypatch, tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 3000)
    monkeypatch.setenv("MONARCH_NB_SYNC_LIMIT_MB", "0.002")
    with pytest.raises(code_sync.SyncError, match=r"3.0 kB in 1 file, more than the 2.0 kB limit"):
        code_sync.scan([str(tmp_path / "a.bin")])
    monkeypatch.setenv("MONARCH_NB_SYNC_LIMIT_MB", "0.004")
    assert list(code_sync.scan([str(tmp_path / "a.bin")])[1]) == ["a.bin"]
    assert code_sync.SIZE_LIMIT_MB == 200


def test_an_unchanged_file_is_not_read_again(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    path.write_text("A = 1\n")
    old = os.stat(path).st_mtime_ns - 10**9
    os.utime(path, ns=(old, old))  # written a second ago: its stat can be trusted
    first = code_sync._digest(str(path))
    reads = []
    monkeypatch.setattr(code_sync, "_read", lambda p: reads.append(p) or b"")
    assert code_sync._digest(str(path)) == first and reads == []
    path.write_text("A = 2\n")  # same size, new stat
    code_sync._digest(str(path))
    assert reads == [str(path)]


def test_a_rewrite_within_the_same_second_is_not_hidden_by_cached_bytecode(clean, tmp_path):
    """Python trusts a cached .pyc whose source has the same size and whole-second mtime: a
    file synced again within that second (same size) must not import as its old self."""
    name, pkg = _package(tmp_path)
    clean.sync(pkg)
    # As Python runs by default (this suite's environment may say PYTHONDONTWRITEBYTECODE).
    clean.run("import sys\nsys.dont_write_bytecode = False")
    clean.run(f"import os, {name}.model as m\nstamp = os.stat(m.__file__).st_mtime_ns")
    (tmp_path / name / "model.py").write_text("def f():\n    return 8\n")
    clean.sync(pkg)
    code = (
        "import sys, importlib\n"
        f"os.utime(m.__file__, ns=(stamp, stamp))  # as if within the same second\n"
        f"del sys.modules[{name + '.model'!r}]\n"
        f"importlib.import_module({name + '.model'!r}).f()"
    )
    try:
        assert clean.run(code).values() == [8, 8]
    finally:
        clean.run(f"sys.dont_write_bytecode = {sys.dont_write_bytecode}")


def test_a_file_just_written_is_hashed_again_even_with_the_same_stat(tmp_path, monkeypatch):
    """Its next change may come within the file system's clock tick, leaving the stat alone."""
    path = tmp_path / "m.py"
    path.write_text("A = 1\n")
    code_sync._digest(str(path))
    reads = []
    monkeypatch.setattr(code_sync, "_read", lambda p: reads.append(p) or b"")
    code_sync._digest(str(path))
    assert reads == [str(path)]


def test_a_controllers_synced_code_goes_when_it_disconnects(clean, tmp_path):
    """A second controller on the same workers (the cluster keeps running when it leaves):
    its directory and sys.path entry go with its links; the first controller's stay."""
    _, pkg = _package(tmp_path)
    clean.sync(pkg)
    other = monarch_nb.connect(clean.scheduler_address, dist=False, current=False)
    try:
        other.sync(pkg)
        theirs = other.call(rank_sync.directory, other.id).values()
    finally:
        other.down()
    ours = clean.call(rank_sync.directory, clean.id).values()
    check = "import os, sys\n[(os.path.isdir(d), d in sys.path) for d in dirs]"
    clean.push({"dirs": [theirs[0], ours[0]]}, targets=[0])
    clean.push({"dirs": [theirs[1], ours[1]]}, targets=[1])
    assert clean.run(check).values() == [[(False, False), (True, True)]] * 2


def test_a_restart_brings_the_synced_code_back(clean, tmp_path):
    """Fresh worker processes have fresh scratch directories: the controller sends the paths
    synced before again, and says so."""
    name, pkg = _package(tmp_path)
    clean.sync(pkg)
    before = clean.run("import os\nos.getpid()").values()
    clean.notices()
    clean.restart()
    notices = clean.notices()
    went = "sync: the synced code went to the new workers: sent "
    assert any(n.startswith(went) and n.endswith(" to ranks 0-1") for n in notices), notices
    after = clean.run(f"import os, {name}.model\n(os.getpid(), {name}.model.f())").values()
    assert [v for _, v in after] == [1, 1]
    assert not set(before) & {pid for pid, _ in after}


def test_paths_with_spaces_and_non_ascii_names_are_quoted_as_in_a_shell(
    clean, cell, tmp_path, monkeypatch
):
    folder = tmp_path / "dir with spaces é"
    folder.mkdir()
    name = f"modé_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text("VALUE = 'é'\n")
    cell(f"%monarch sync '{folder / name}.py'")  # the quotes were kept as part of the path
    assert cell.out.strip() == "monarch-nb: sync: sent 1 file (13 B) to ranks 0-1"
    assert cell(f"%%monarch\nimport {name}\n{name}.VALUE").values() == ["é", "é"]
    monkeypatch.chdir(tmp_path)
    cell(f'%monarch sync "dir with spaces é/{name}.py" --targets 1')
    assert cell.out.strip().endswith("rank 1 already had all 1 file (13 B); nothing sent")

    (folder / "show args é.py").write_text("import sys\nprint(sys.argv[1:])\n")
    cell(r"%monarch run --targets 0 dir\ with\ spaces\ é/'show args é.py' 'a b' \"c\"")
    assert "[rank 0] ['a b', '\"c\"']" in cell.out
