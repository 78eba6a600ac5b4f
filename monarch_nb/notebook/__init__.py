"""In the notebook's kernel process, what IPython and Jupyter show: the ``%monarch`` magics, the
live panel, widgets relayed from ranks, bokeh figures."""
