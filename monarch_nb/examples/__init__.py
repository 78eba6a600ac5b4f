"""What the notebooks and benchmarks run, shipped in the package so that a notebook handed out
runs wherever monarch_nb is installed, with nothing beside it:

- ``train_digits``: a torchrun-style training script, run on every rank as a child process
  (``%monarch run -m monarch_nb.examples.train_digits``) or under ``torchrun -m``;
- ``slurm_site``: a Slurm site's cluster factory, called in the notebook's kernel
  (``%monarch connect --cluster monarch_nb.examples.slurm_site:make_cluster``).
"""
