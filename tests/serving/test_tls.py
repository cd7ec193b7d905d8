"""--ssl_config_file: TLS on the gRPC port, mutual TLS with client_verify, and clear errors for bad files."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress

import grpc
import numpy as np
import pytest
import tensorflow as tf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving.tls import SslConfig, SslConfigError, read_ssl_config, secure_channel

pytestmark = pytest.mark.timeout(180)


@dataclasses.dataclass(frozen=True)
class Pki:
    ca_cert: bytes
    server_key: bytes
    server_cert: bytes
    client_key: bytes
    client_cert: bytes  # signed by ca_cert
    stranger_key: bytes
    stranger_cert: bytes  # signed by another CA, which also signs stranger_ca_cert
    stranger_ca_cert: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key, password: bytes | None = None) -> bytes:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _cert(key, name: str, issuer_key, issuer_name: str | None = None, *, ca: bool = False,
          server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name or name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki() -> Pki:
    """A self-signed CA, a server certificate for 127.0.0.1/localhost and a client certificate, both
    signed by it; and a client certificate from another CA."""
    ca_key, stranger_ca_key = _key(), _key()
    ca = _cert(ca_key, "test CA", ca_key, ca=True)
    stranger_ca = _cert(stranger_ca_key, "stranger CA", stranger_ca_key, ca=True)
    server_key, client_key, stranger_key = _key(), _key(), _key()
    return Pki(ca_cert=_pem(ca),
               server_key=_pem_key(server_key), server_cert=_pem(_cert(server_key, "localhost", ca_key, "test CA",
                                                                        server=True)),
               client_key=_pem_key(client_key), client_cert=_pem(_cert(client_key, "client", ca_key, "test CA")),
               stranger_key=_pem_key(stranger_key),
               stranger_cert=_pem(_cert(stranger_key, "stranger", stranger_ca_key, "stranger CA")),
               stranger_ca_cert=_pem(stranger_ca))


def ssl_config_text(server_key: bytes, server_cert: bytes, custom_ca: bytes = b"", client_verify: bool = False) -> str:
    """An SSLConfig text proto with the PEM texts inline, as TF Serving reads it."""
    quoted = lambda pem: '"' + pem.decode().replace("\n", "\\n") + '"'  # noqa: E731
    lines = [f"server_key: {quoted(server_key)}", f"server_cert: {quoted(server_cert)}"]
    if custom_ca:
        lines.append(f"custom_ca: {quoted(custom_ca)}")
    if client_verify:
        lines.append("client_verify: true")
    return "\n".join(lines) + "\n"


def predict(channel: grpc.Channel) -> list[float]:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half_plus_two"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[1.0], [2.0]], np.float32)))
    response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=20)
    return list(response.outputs["y"].float_val)


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        predict(channel)
    return error.value.code()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, pki, copy_testdata):
    """In-process server: TLS, no client certificates requested."""
    from server_helpers import serving
    from serving.manager.model_config import single_model_config
    from serving.manager.model_manager import ModelManager

    root = tmp_path_factory.mktemp("tls")
    base = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    manager = ModelManager(file_system_poll_wait_seconds=0)
    manager.reload_config(single_model_config("half_plus_two", base))
    path = root / "ssl.config"
    path.write_text(ssl_config_text(pki.server_key, pki.server_cert))
    with serving(manager, ssl_config=read_ssl_config(path)) as server:
        yield server.grpc_address
    manager.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki, copy_testdata, start_server):
    """`python -m serving --ssl_config_file` with client_verify: the flag end to end."""
    root = tmp_path_factory.mktemp("mtls")
    base = copy_testdata("saved_model_half_plus_two_cpu", root / "half_plus_two")
    path = root / "ssl.config"
    path.write_text(ssl_config_text(pki.server_key, pki.server_cert, pki.ca_cert, client_verify=True))
    server = start_server("--model_name=half_plus_two", f"--model_base_path={base}", f"--ssl_config_file={path}",
                          log_dir=root)
    yield server.address
    assert server.stop() == 0


def test_tls_client_trusting_the_ca_is_served(tls_server, pki):
    with secure_channel(tls_server, pki.ca_cert) as channel:
        assert predict(channel) == [2.5, 3.0]


def test_tls_port_refuses_plaintext_and_untrusting_clients(tls_server, pki):
    with grpc.insecure_channel(tls_server) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    with secure_channel(tls_server, pki.stranger_ca_cert) as channel:  # the server's certificate is not trusted
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_accepts_a_client_certificate_signed_by_custom_ca(mtls_server, pki):
    with secure_channel(mtls_server, pki.ca_cert, private_key=pki.client_key,
                        certificate_chain=pki.client_cert) as channel:
        assert predict(channel) == [2.5, 3.0]


def test_mutual_tls_refuses_clients_without_a_valid_certificate(mtls_server, pki):
    with secure_channel(mtls_server, pki.ca_cert) as channel:  # TLS, but no client certificate
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    with secure_channel(mtls_server, pki.ca_cert, private_key=pki.stranger_key,
                        certificate_chain=pki.stranger_cert) as channel:  # signed by another CA
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(mtls_server) as channel:
        assert refused(channel) == grpc.StatusCode.UNAVAILABLE
    with secure_channel(mtls_server, pki.ca_cert, private_key=pki.client_key,
                        certificate_chain=pki.client_cert) as channel:  # and the server is still up
        assert predict(channel) == [2.5, 3.0]


def test_ssl_config_keeps_the_key_out_of_its_repr(tmp_path, pki):
    path = tmp_path / "ssl.config"
    path.write_text(ssl_config_text(pki.server_key, pki.server_cert, pki.ca_cert, client_verify=True))
    config = read_ssl_config(path)
    assert config == SslConfig(pki.server_key.decode(), pki.server_cert.decode(), pki.ca_cert.decode(), True)
    assert "PRIVATE KEY" not in repr(config)


BAD_CONFIGS = {
    "no key": (lambda p: ssl_config_text(b"", p.server_cert), "server_key is empty"),
    "verify without CA": (lambda p: ssl_config_text(p.server_key, p.server_cert, client_verify=True),
                          "client_verify needs custom_ca"),
    "cert not PEM": (lambda p: ssl_config_text(p.server_key, b"not a certificate"),
                     "server_cert is not a PEM certificate"),
    "CA not PEM": (lambda p: ssl_config_text(p.server_key, p.server_cert, b"-----BEGIN CERTIFICATE-----\nxx"),
                   "custom_ca is not a PEM certificate"),
    "key not PEM": (lambda p: ssl_config_text(b"garbage", p.server_cert), "server_key is not a PEM private key"),
    "key of another cert": (lambda p: ssl_config_text(p.client_key, p.server_cert),
                            "server_key does not belong to server_cert"),
    "encrypted key": (lambda p: ssl_config_text(_pem_key(_key(), b"secret"), p.server_cert), "server_key is encrypted"),
    "unknown field": (lambda p: "server_key: 'x'\nclient_verfy: true\n", "client_verfy"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_ssl_configs_are_named_in_one_line(tmp_path, pki, case):
    text, message = BAD_CONFIGS[case]
    path = tmp_path / "ssl.config"
    path.write_text(text(pki))
    with pytest.raises(SslConfigError, match=message) as error:
        read_ssl_config(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_bad_ssl_config_file_exits_2_before_loading_anything(tmp_path, capsys):
    from serving.__main__ import main

    assert main(["--model_name=m", f"--model_base_path={tmp_path}", f"--ssl_config_file={tmp_path / 'missing'}"]) == 2
    assert f"--ssl_config_file: cannot read {tmp_path / 'missing'}: No such file or directory" in capsys.readouterr().err
