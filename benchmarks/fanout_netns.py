"""Simulated hosts as network namespaces for the fan-out benchmark: each stand-in process
(fanout_standin.py) runs in a namespace of its own on a bridge, with a host name of its own,
as tests/_netns.py builds them for the Slurm test (its ``Network`` is used as it is). From the
controller's namespace a rank there is reachable by TCP only (an abstract Unix-domain socket
belongs to its namespace), as a rank on another machine is. Needs CAP_NET_ADMIN (root)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from fanout_ctl import Host

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

import _netns  # tests/_netns.py (which imports pytest: a development dependency)

FIRST_OCTET = 2  # the hosts' addresses: 10.77.N.2 and up (.1 is the controller's)


def why_not() -> str | None:
    """Why this machine cannot make the namespaces, or None."""
    return _netns.why_not()


@contextlib.contextmanager
def hosts(count: int, ranks: int):
    """``count`` namespaces, each with a stand-in process of ``ranks`` ranks, and ``cut(i)``,
    which takes host i's link down (it vanishes, closing nothing); all of them removed
    afterwards, whatever happens."""
    roles = {f"h{i:02d}": FIRST_OCTET + i for i in range(count)}
    with tempfile.TemporaryDirectory(prefix="fanout-netns-") as logs:
        net = _netns.Network(roles, Path(logs))
        started: list[Host] = []
        try:
            net.build()
            for role in roles:
                started.append(Host(ranks, net.address(role), prefix=_inside(net, role)))
            names = list(roles)
            yield started, lambda i: net.link(names[i], "down")
        finally:
            for host in started:
                host.close()
            net.close()


def _inside(net, role: str) -> list[str]:
    """The command prefix that runs a program in ``role``'s namespace, named ``mnb-ROLE``
    (``Network.start``'s, whose output goes to a log: a stand-in's first line is read here)."""
    name = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"mnb-{role}"]
    return ["nsenter", f"--net=/run/netns/{net.ns(role)}", *name]
