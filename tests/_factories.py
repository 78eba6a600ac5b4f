"""Cluster factories for ``%monarch connect --cluster _factories:NAME`` in the tests."""

from distributed import LocalCluster


def one_worker():
    return LocalCluster(n_workers=1, processes=True, host="127.0.0.1", dashboard_address=":0")


class Unscalable:
    """A cluster object without ``scale()``, as a site's wrapper around its cluster may be:
    everything else is the LocalCluster's."""

    def __init__(self):
        self._cluster = one_worker()

    def __getattr__(self, name):
        if name == "scale":
            raise AttributeError(name)
        return getattr(self._cluster, name)

    def __await__(self):
        return self._cluster.__await__()


def unscalable():
    return Unscalable()
