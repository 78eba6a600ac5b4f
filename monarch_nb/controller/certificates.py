"""The TLS a cluster's comms speak: a local cluster's temporary certificate, and the
certificates a controller joins a TLS scheduler with (``--tls``, ``--tls-ca-file``,
``--tls-cert``, ``--tls-key``, or Dask's ``distributed.comm.tls`` config)."""

from __future__ import annotations

import importlib.util
import os

_NO_CRYPTOGRAPHY = (
    "--tls needs the cryptography package for its temporary certificates: pip install cryptography"
)


def temporary_security():
    """A ``distributed.Security`` with a fresh self-signed certificate kept in memory, shared by
    the scheduler, the workers and the client of one local cluster (needs ``cryptography``)."""
    from distributed import Security

    try:
        return Security.temporary()
    except ImportError:
        raise ValueError(_NO_CRYPTOGRAPHY) from None


def check_temporary() -> None:
    """``temporary_security``'s refusal, without making a key: for a cluster whose certificate
    another process makes (a kept cluster's host)."""
    if importlib.util.find_spec("cryptography") is None:
        raise ValueError(_NO_CRYPTOGRAPHY)


def client_security(
    tls: bool = False,
    ca_file: str | None = None,
    cert: str | None = None,
    key: str | None = None,
):
    """The ``distributed.Security`` a controller joins a scheduler with, or None for plain TCP.

    ``ca_file``/``cert``/``key`` are PEM files (the CA that signed the cluster's certificates,
    and this client's certificate and key); ``tls=True`` alone takes them from Dask's config
    (``distributed.comm.tls.ca-file`` and ``distributed.comm.tls.client.cert``/``key``).
    """
    from distributed import Security

    files = {"ca_file": ca_file, "cert": cert, "key": key}
    if not tls and all(v is None for v in files.values()):
        return None
    for flag, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--tls-{flag.replace('_', '-')}: no file at {path!r}")
    if ca_file is None and cert is None and key is None:
        security = Security(require_encryption=True)
    else:
        if ca_file is None or cert is None:
            raise ValueError(
                "TLS needs both --tls-ca-file and --tls-cert (and --tls-key unless the "
                "certificate file holds the key)"
            )
        security = Security(
            require_encryption=True,
            tls_ca_file=ca_file,
            tls_client_cert=cert,
            tls_client_key=key,
        )
    if not security.get_connection_args("client").get("ssl_context"):
        raise ValueError(
            "--tls: Dask's config names no TLS certificates; pass --tls-ca-file, --tls-cert "
            "and --tls-key, or set distributed.comm.tls.ca-file and "
            "distributed.comm.tls.client.cert/key"
        )
    return security
