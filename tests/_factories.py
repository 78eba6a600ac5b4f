"""Cluster factories for ``%monarch connect --cluster _factories:NAME`` in the tests."""

from distributed import LocalCluster


def one_worker():
    return LocalCluster(n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0")
