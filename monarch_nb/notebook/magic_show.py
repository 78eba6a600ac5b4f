"""The ``%monarch`` commands that show what the ranks log and sample: metrics (a table), dashboard
(a live panel) and plot (a static figure). Each is ``fn(magics, args)``."""

from __future__ import annotations

from IPython.core.error import UsageError

from monarch_nb.notebook import plots
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


def metrics_table(magics, args):
    controller()
    print(metrics.format_latest())
