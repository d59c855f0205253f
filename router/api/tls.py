"""TLS / mTLS credentials of the external gRPC port (the HTTP port stays plain, as in TGIS).

TLS_CERT_PATH + TLS_KEY_PATH enable TLS; TLS_CLIENT_CA_CERT_PATH additionally requires every
client to present a certificate signed by that CA. Problems are one line naming the path,
with TGIS's wording. Called by router/server.py at startup.
"""

from __future__ import annotations

import grpc


class TlsConfigError(ValueError):
    """A TLS file is missing or unreadable, or only half of cert/key is given."""


def _read(what: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsConfigError(f"couldn't load {what} from {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"couldn't load {what} from {path}: not a PEM file")
    return data


def server_credentials(
    cert_path: str | None, key_path: str | None, client_ca_cert_path: str | None
) -> grpc.ServerCredentials | None:
    """Credentials for the gRPC port; None when TLS is off."""
    if not cert_path and not key_path:
        if client_ca_cert_path:
            raise TlsConfigError("tls: a client CA needs a server cert and key")
        return None
    if not cert_path or not key_path:
        raise TlsConfigError("tls: must provide both cert and key")
    cert = _read("cert", cert_path)
    key = _read("key", key_path)
    client_ca = _read("client ca cert", client_ca_cert_path) if client_ca_cert_path else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
