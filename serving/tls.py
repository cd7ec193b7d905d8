"""TLS and mutual TLS for the gRPC port (`--ssl_config_file`), and the client side of it.

The file is TF Serving's SSLConfig text proto (tensorflow_serving/config/ssl_config.proto), with the
PEM texts inline, as TF Serving reads it:

    server_key: "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----"
    server_cert: "-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----"
    custom_ca: "-----BEGIN CERTIFICATE-----\n..."    # the CA that signs client certificates
    client_verify: true                                # mutual TLS: no valid client certificate, no call

As in TF Serving's server.cc (BuildServerCredentialsFromSSLConfigFile), client_verify asks for and
verifies a client certificate (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY), and without
it no client certificate is requested. Unlike TF Serving, which aborts on a bad file or hands gRPC
PEM texts it then refuses with "Failed to bind", the file is checked up front and a problem is named
in one line (client_verify without custom_ca is one: gRPC cannot verify without a CA). TLS covers the
gRPC port only: TF Serving's REST server is plain HTTP, and so is ours.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import tempfile
from pathlib import Path

import grpc

from serving import text_proto


class SslConfigError(ValueError):
    """A --ssl_config_file that cannot be read, does not parse, or holds unusable PEM texts."""


# TF Serving's SSLConfig message (ssl_config.proto, which the pip package lacks).
SSLConfigProto = text_proto.message_class(
    "serving/ssl_config.proto", "tensorflow.serving.SSLConfig",
    {"SSLConfig": [("server_key", 1, "string"), ("server_cert", 2, "string"), ("custom_ca", 3, "string"),
                   ("client_verify", 4, "bool")]})


@dataclasses.dataclass(frozen=True)
class SslConfig:
    """The checked PEM texts; repr leaves the private key out, so it never reaches a log."""

    server_key: str = dataclasses.field(repr=False)
    server_cert: str
    custom_ca: str = ""
    client_verify: bool = False


def read_ssl_config(path: str | os.PathLike) -> SslConfig:
    """Reads and checks a --ssl_config_file.

    Raises:
        SslConfigError: one line naming the file and what is wrong with it.
    """
    proto = text_proto.read_text_proto(  # read errors name no flag: the caller prefixes "--ssl_config_file: "
        path, SSLConfigProto, SslConfigError,
        hint="expected TF Serving's SSLConfig: server_key, server_cert, custom_ca, client_verify")
    config = SslConfig(proto.server_key, proto.server_cert, proto.custom_ca, proto.client_verify)
    problem = _problem(config)
    if problem:
        raise SslConfigError(f"{path}: {problem}")
    return config


def _problem(config: SslConfig) -> str | None:
    """What makes the PEM texts unusable, checked with the standard library's OpenSSL (None: usable)."""
    for name in ("server_key", "server_cert"):
        if not getattr(config, name).strip():
            return f"{name} is empty; put the PEM text inline, e.g. {name}: \"-----BEGIN ...\\n...\""
    if config.client_verify and not config.custom_ca.strip():
        return "client_verify needs custom_ca: the PEM certificate of the CA that signs client certificates"
    for name in ("server_cert", "custom_ca"):
        pem = getattr(config, name)
        if pem.strip():
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=pem)
            except (ssl.SSLError, ValueError):
                return f"{name} is not a PEM certificate (expected '-----BEGIN CERTIFICATE-----' ...)"
    with tempfile.TemporaryDirectory() as private:  # mode 0700; OpenSSL's Python API reads key pairs from files
        cert_path, key_path = Path(private, "cert.pem"), Path(private, "key.pem")
        cert_path.write_text(config.server_cert)
        key_path.touch(mode=0o600)
        key_path.write_text(config.server_key)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=_no_password)
        except _Encrypted:
            return "server_key is encrypted; gRPC needs an unencrypted PEM private key"
        except ssl.SSLError as error:
            if "KEY_VALUES_MISMATCH" in str(error):
                return "server_key does not belong to server_cert (their public keys differ)"
            return "server_key is not a PEM private key (expected '-----BEGIN PRIVATE KEY-----' ...)"
    return None


class _Encrypted(Exception):
    pass


def _no_password() -> str:
    raise _Encrypted()


def server_credentials(config: SslConfig) -> grpc.ServerCredentials:
    """gRPC server credentials as TF Serving builds them: client certificates required iff client_verify."""
    return grpc.ssl_server_credentials([(config.server_key.encode(), config.server_cert.encode())],
                                       root_certificates=config.custom_ca.encode() or None,
                                       require_client_auth=config.client_verify)


def secure_channel(address: str, root_certificates: bytes | None = None, *, private_key: bytes | None = None,
                   certificate_chain: bytes | None = None,
                   options: list[tuple[str, int | str]] | None = None) -> grpc.Channel:
    """A client's TLS channel to "host:port" (the server's certificate must name host as a DNS or IP SAN).

    Args:
        root_certificates: PEM of the CA that signed the server's certificate; None trusts the system's roots.
        private_key, certificate_chain: the client's own PEM key and certificate, for mutual TLS.
    """
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates, private_key=private_key,
                                               certificate_chain=certificate_chain)
    return grpc.secure_channel(address, credentials, options=options)
