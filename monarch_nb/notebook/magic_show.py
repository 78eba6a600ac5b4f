"""The ``%monarch`` commands that show what the ranks log and sample: metrics (a table), dashboard
(a live panel), plot (a static figure) and profile (a profiled cell's timeline again). Each is
``fn(magics, args)``."""

from __future__ import annotations

from pathlib import Path

from IPython.core.error import UsageError

from monarch_nb import errors
from monarch_nb.controller import profiling
from monarch_nb.notebook import plots, profile_view
from monarch_nb.notebook.magic_cluster import controller, guard
from monarch_nb.notebook.widgets import NO_WIDGETS, LivePanel, static_bundle, widgets_available
from monarch_nb.telemetry import metrics


def dashboard(magics, args):
    ctl = controller()
    if magics.dashboard is not None:  # one live panel: the older one keeps its last values
        magics.dashboard.freeze()
        magics.dashboard = None
    from IPython.display import display

    if not widgets_available():
        display(static_bundle(ctl, "monarch-nb dashboard", NO_WIDGETS), raw=True)
        return
    magics.dashboard = LivePanel(ctl, title="monarch-nb dashboard")
    magics.dashboard.show()
    magics.dashboard.start()


def plot(magics, args):
    history = metrics.history()
    if not history.names():
        raise UsageError(
            "plot: nothing was logged yet; call monarch_nb.log(step=..., loss=...) "
            "in a %%monarch cell first"
        )
    if args.save:
        path = guard(lambda: plots.save(history, args.save))
        print(f"monarch-nb: wrote {path}")
        return None
    return plots.show(history)


def profile(magics, args):
    """``%monarch profile --last`` (this cluster's newest, this kernel's or an earlier one's) or
    ``%monarch profile DIR``."""
    if args.last == (args.folder is not None):
        raise UsageError("profile: give --last or a profile's folder (DIR), one of them")
    if args.folder is not None:
        folder = Path(args.folder).expanduser()
        if not (folder / "meta.json").is_file():
            raise UsageError(f"profile: {folder} holds no profile (no meta.json in it)")
        shown = guard(lambda: profiling.load(folder))
    else:
        ctl = errors.current()
        shown = guard(lambda: profiling.last(ctl if ctl is not None and not ctl.closed else None))
    profile_view.show(shown.analysis, shown.title, str(shown.directory))


def metrics_table(magics, args):
    controller()
    print(metrics.format_latest())
