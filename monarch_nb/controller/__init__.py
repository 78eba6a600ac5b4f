"""The single controller, in the notebook's kernel process: making or joining a cluster, the rank
table, sending cells and requests to the ranks and gathering what comes back."""
