"""The request relay: a process on the controller's host that writes each request to the ranks'
engines there, so that the notebook's process sends one message however many ranks a request
goes to (dispatch/relaying.py starts it and speaks to it). It runs no user code and imports
nothing but the standard library: it starts in a few tens of milliseconds."""
