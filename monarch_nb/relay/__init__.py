"""The relays: processes that run no user code and import nothing but the standard library, so
they start in a few tens of milliseconds. ``main.py``, the request relay on the controller's
host, writes each request to the ranks' engines there, so that the notebook's process sends one
message however many ranks a request goes to (dispatch/relaying.py starts it and speaks to it).
``host.py``, the relay on every other host, started by a worker there (``start.py``), carries
that host's requests and its ranks' replies, batched (dispatch/host_relays.py speaks to it)."""
