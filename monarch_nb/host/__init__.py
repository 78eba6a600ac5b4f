"""The host of a kept cluster (``%monarch up --keep``): a process in a session of its own that
runs the cluster's scheduler and nannies, so that they and the ranks' namespaces outlive the
kernel, and lends the cluster to one kernel at a time. ``main.py`` starts and stops it,
``lease.py`` says which kernel holds it and how long it has been idle."""
