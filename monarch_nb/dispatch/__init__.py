"""A request's way to the ranks and back, in the notebook's kernel process: the targets named,
the links to the ranks, sending and gathering, the outputs and results merged and shown, the
debugger prompt and the ranks that do not answer. The controller (controller/) drives it with
its rank table, through what protocol.py says it needs of one."""
