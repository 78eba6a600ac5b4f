"""What the notebooks and benchmarks run, shipped in the package so that a notebook handed out
runs wherever monarch_nb is installed, with nothing beside it:

- ``train_digits``: a torchrun-style training script, run on every rank as a child process
  (``%monarch run -m monarch_nb.examples.train_digits``) or under ``torchrun -m``;
- ``slurm_site``: a Slurm site's cluster factory, called in the notebook's kernel
  (``%monarch connect --cluster monarch_nb.examples.slurm_site:make_cluster``);
- imported by the ranks and the kernel alike (torch only): ``transformer`` (the parallelism
  lessons' model and loop), ``parallel_costs`` (memory, bytes and pipeline schedules by
  formula), ``pipeline`` (a pipeline stage's loop);
- imported by the kernel only (bokeh, Dask): the lessons' pictures (``collectives_plots``,
  ``monarch_plots``, ``parallel_plots``, ``checkpoint_plots``), ``parallel_runs`` (each
  strategy's results side by side) and ``dask_processes`` (lesson 6's separate processes);
- ``exercises``: a checker module per lesson (docs/teaching.md).
"""
