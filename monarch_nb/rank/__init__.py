"""In each Dask worker process (a rank): the engine that runs cells in the rank's namespace, the
capture of what they print, and the rank's side of widgets and child processes."""
