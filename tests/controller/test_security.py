"""Security defaults: local clusters listen on 127.0.0.1 only; ``--tls`` clusters refuse plain TCP
and clients whose certificates they did not issue, while cells, push/pull and the process group
work over TLS."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import time
from pathlib import Path

import dask
import psutil
import pytest
from distributed import Client, Security

import monarch_nb
from monarch_nb.controller import cluster as clusters

ROOT = Path(__file__).parents[2]


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def _refused(address: str, security=None) -> str:
    """Try a Dask client at ``address``; the reason it failed (the test fails if it joins)."""
    start = time.monotonic()
    try:
        client = Client(address, security=security, timeout=3, set_as_default=False)
    except Exception as e:
        assert time.monotonic() - start < 15
        return f"{type(e).__name__}: {e}"
    client.close()
    pytest.fail(f"a client joined {address} with security={security!r}")


def test_local_cluster_listens_on_loopback_only(no_current):
    before = _listening(os.getpid())
    ctl = monarch_nb.up(workers=2, cpu=True, current=False)
    try:
        assert ctl.dist_backend == "gloo", ctl.dist_error  # its store and pairs listen too
        ctl.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)")
        assert ctl.scheduler_address.startswith("tcp://127.0.0.1:")
        assert ctl.client.dashboard_link.startswith("http://127.0.0.1:")
        sockets = {"controller (scheduler, dashboard, nannies)": _listening(os.getpid()) - before}
        for row in ctl.status():
            sockets[f"rank {row['rank']}"] = _listening(row["pid"])
        assert all(sockets.values()), sockets
        exposed = {
            who: sorted(s for s in found if not ipaddress.ip_address(s[0]).is_loopback)
            for who, found in sockets.items()
        }
        assert not any(exposed.values()), f"listening beyond loopback: {exposed}"
    finally:
        ctl.down()


def test_make_lab_binds_jupyterlab_to_loopback():
    lab = re.search(r"^lab:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.M | re.S).group(0)
    assert "--ServerApp.ip=127.0.0.1" in lab


def test_tls_cluster_works_and_refuses_plain_tcp(no_current, cell, tmp_path):
    cell("%monarch up --tls --workers 2 --cpu")
    ctl = monarch_nb.current()
    address = ctl.scheduler_address
    assert address.startswith("tls://127.0.0.1:") and f"at {address}" in cell.out
    assert "gloo process group over all ranks" in cell.out
    workers = clusters.workers(ctl.client)
    assert len(workers) == 2 and all(w.startswith("tls://127.0.0.1:") for w in workers)

    # Cells, push/pull and the process group, all over TLS.
    cell("%monarch push base=10")
    cell("%%monarch\nimport torch, torch.distributed as dist\nt = torch.tensor([base + rank])")
    cell("%%monarch\ndist.all_reduce(t)\nout = t.item()")
    assert cell("%monarch pull out").values() == [21, 21]

    # Plain TCP to the scheduler or a worker, and TLS with certificates of another CA: refused.
    plain = address.replace("tls://", "tcp://")
    assert _refused(plain)
    for worker in workers:
        assert _refused(worker.replace("tls://", "tcp://"))
    assert _refused(address, security=Security.temporary())
    with pytest.raises(monarch_nb.ClusterError, match="speaks TLS"):
        monarch_nb.connect(address, current=False, timeout=3)
    with pytest.raises(monarch_nb.ClusterError):
        monarch_nb.connect(plain, current=False, timeout=3, dist=False)

    # The cluster keeps working after the refusals.
    assert cell("%%monarch\nrank * 2").values() == [0, 2]
    cell("%monarch down")
    assert "cluster shut down" in cell.out


def test_connect_with_tls_certificate_files(no_current, cell, tmp_path):
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False, tls=True, current=False)
    try:
        sec = ctl.client.security
        files = {
            "ca.pem": sec.tls_ca_file,
            "client.pem": sec.tls_client_cert,
            "client-key.pem": sec.tls_client_key,
        }
        for name, pem in files.items():
            (tmp_path / name).write_text(pem)
            (tmp_path / name).chmod(0o600)
        ca, cert, key = (tmp_path / name for name in files)
        cell(
            f"%monarch connect {ctl.scheduler_address} --no-dist --tls-ca-file {ca} "
            f"--tls-cert {cert} --tls-key {key}",
        )
        assert f"connected to 1 rank at {ctl.scheduler_address}" in cell.out
        assert cell("%%monarch\nworld_size").values() == [1]
        cell("%monarch down")
        assert "disconnected; the cluster keeps running" in cell.out

        # --tls alone: the same certificates, named in Dask's config.
        tls_config = {
            "distributed.comm.tls.ca-file": str(ca),
            "distributed.comm.tls.client.cert": str(cert),
            "distributed.comm.tls.client.key": str(key),
        }
        with dask.config.set(tls_config):
            cell(f"%monarch connect {ctl.scheduler_address} --no-dist --tls")
        assert cell("%%monarch\nrank").values() == [0]
        cell("%monarch down")

        cell(f"%monarch connect {ctl.scheduler_address} --tls", expect_error=True)
        assert "names no TLS certificates" in str(cell.error)
        scheduler_file = tmp_path / "scheduler.json"
        scheduler_file.write_text(json.dumps({"address": ctl.scheduler_address}))
        cell(f"%monarch connect --scheduler-file {scheduler_file}", expect_error=True)
        assert "speaks TLS" in str(cell.error)
        cell(f"%monarch connect {ctl.scheduler_address} --tls-cert {cert}", expect_error=True)
        assert "--tls-ca-file" in str(cell.error)
        cell(
            f"%monarch connect {ctl.scheduler_address} --tls-ca-file nowhere.pem", expect_error=True
        )
        assert "no file at 'nowhere.pem'" in str(cell.error)
        assert ctl.run("rank").values() == [0]  # the first controller is unaffected
    finally:
        ctl.down()
