"""The single controller, in the notebook's kernel process: making or joining a cluster, its rank
table and its workers (started, kept, scaled, restarted, shut down), and the commands that need
the whole controller. A request's way to the ranks and back is the dispatch folder's."""
