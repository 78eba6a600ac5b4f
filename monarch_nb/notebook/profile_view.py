"""What ``%%monarch --profile`` leaves under the cell: the numbers as text, always (nbclient,
a terminal and the tests read them), and the timeline as a bokeh widget where IPython runs."""

from __future__ import annotations

from monarch_nb.telemetry.profile_model import Analysis


def show(analysis: Analysis, title: str, directory: str | None) -> None:
    """Print the text form, then draw the timeline and its table under the cell. bokeh is
    imported here, when a profile is shown, not when the kernel starts."""
    from monarch_nb.telemetry import timeline_figure

    print(f"profile of {title}")
    print(timeline_figure.text(analysis, directory))
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:  # a plain script: the text is all
        return
    from monarch_nb.notebook import bokeh_display

    bokeh_display.show(timeline_figure.layout(analysis, title))
