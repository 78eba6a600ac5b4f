"""``%monarch sync`` of a 50 MB package: a second sync with nothing changed (the issue's target
is 0.2 s), one file changed, and the first sync, against Dask's ``client.upload_file`` of the
same package zipped (what a sync would be without the controller's data path).

The package is generated in a temporary folder: 1,000 .py files of 10 kB in 20 subpackages
and 4 data files of 10 MB. Times are ``Controller.sync`` (what ``%monarch sync`` calls) from
the call to its report, on a local cluster of CPU worker processes.

    python benchmarks/bench_sync.py                # 2 ranks, 20 repeats
    python benchmarks/bench_sync.py --ranks 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import machine

TARGET_S = 0.2


def make_package(root: Path) -> Path:
    pkg = root / "bigpkg"
    for sub in range(20):
        folder = pkg / f"part{sub:02d}"
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        for i in range(50):
            defs = (f"def f{i}_{j}(x):\n    return x * {j}  # padding\n" for j in range(999))
            body, size = [], 0
            for d in defs:  # whole functions, about 10 kB
                if size + len(d) > 10_000:
                    break
                body.append(d)
                size += len(d)
            (folder / f"mod{i:02d}.py").write_text("".join(body))
    (pkg / "__init__.py").write_text("")
    data = pkg / "data"
    data.mkdir()
    for i in range(4):
        (data / f"weights{i}.bin").write_bytes(os.urandom(10_000_000))
    return pkg


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(args) -> None:
    began = time.perf_counter()
    import monarch_nb

    with tempfile.TemporaryDirectory() as tmp:
        pkg = make_package(Path(tmp))
        size = sum(p.stat().st_size for p in pkg.rglob("*") if p.is_file())
        count = sum(1 for p in pkg.rglob("*") if p.is_file())
        archive = Path(tmp) / "bigpkg.zip"
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
            for p in pkg.rglob("*"):
                z.write(p, p.relative_to(pkg.parent))
        ctl = monarch_nb.up(workers=args.ranks, cpu=True)
        try:
            first, report = timed(lambda: ctl.sync(pkg))
            assert report.files == count, report
            again = []
            for _ in range(args.repeats):
                took, report = timed(lambda: ctl.sync(pkg))
                assert not report.updated, report
                again.append(took)
            changed = []
            target = pkg / "part00" / "mod00.py"
            for i in range(args.repeats):
                target.write_text(f"VERSION = {i}\n")
                took, report = timed(lambda: ctl.sync(pkg))
                assert report.files == 1, report
                changed.append(took)
            upload, _ = timed(lambda: ctl.client.upload_file(str(archive), load=False))
            imported = ctl.run("import bigpkg.part19.mod49 as m; m.f49_3(2)", quiet=True)
            assert imported.values() == [6] * args.ranks
        finally:
            ctl.down()
    p50, worst = statistics.median(again), max(again)
    lines = [
        "monarch-nb %monarch sync benchmark",
        f"machine: {machine.cpu()}",
        f"software: {machine.versions(('torch', 'monarch-nb', 'distributed'))}",
        f"{args.ranks} CPU ranks, local cluster; a package of {count} files, {size / 1e6:.1f} MB; "
        f"{args.repeats} repeats; times in s",
        "",
        f"{'sync':<44}{'p50':>8}{'max':>8}{'target':>8}  met",
        f"{'second sync, nothing changed':<44}{p50:>8.3f}{worst:>8.3f}{TARGET_S:>8.1f}  "
        f"{'yes' if worst <= TARGET_S else 'NO'}",
        f"{'one .py file changed':<44}{statistics.median(changed):>8.3f}{max(changed):>8.3f}",
        f"{'first sync (everything sent)':<44}{first:>8.3f}",
        f"{'Dask client.upload_file of the same, zipped':<44}{upload:>8.3f}",
        "",
        f"total wall time: {time.perf_counter() - began:.0f} s",
    ]
    print("\n".join(lines))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse())
