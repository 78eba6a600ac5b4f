"""``%monarch sync PATH...`` and ``%monarch autoreload on|off``: code edited next to the notebook
reaches the ranks without a shared file system or a restart (controller/sync.py sends it,
rank/autoreload.py reloads it)."""

from __future__ import annotations

from monarch_nb.notebook.magic_cluster import controller, guard


def sync(magics, args) -> None:
    """``%monarch sync model.py mypkg`` sends the file and the package folder to every rank,
    on its ``sys.path``; again, only what changed::

        In [3]: %monarch sync mypkg
        monarch-nb: sync: sent 12 files (48.1 kB) to ranks 0-1
        In [4]: %monarch sync mypkg
        monarch-nb: sync: ranks 0-1 already had all 12 files (48.1 kB); nothing sent
    """
    ctl = controller()
    report = guard(lambda: ctl.sync(*args.paths, targets=args.targets))
    print(f"monarch-nb: sync: {report}")


def autoreload(magics, args) -> None:
    """``%monarch autoreload on``: before each ``%%monarch`` cell, every rank reloads the modules
    changed since its last cell (IPython's ``%autoreload 2``); ``off`` stops it."""
    ctl = controller()
    on = args.state == "on"
    guard(lambda: ctl.autoreload(on))
    if on:
        print(
            "monarch-nb: autoreload on: before each cell the ranks reload the modules changed "
            "since their last cell; %monarch autoreload off stops it"
        )
    else:
        print("monarch-nb: autoreload off")
