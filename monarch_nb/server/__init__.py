"""The Jupyter server extension, in the Jupyter server process: the sidebar's REST API, the
dashboard proxy and BokehJS for the lab extension."""

from monarch_nb.server.handlers import (
    _jupyter_server_extension_points,
    _load_jupyter_server_extension,
)

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]
