"""TLS certificates for the gRPC tests and bench/serve_overhead.py's TLS rows: a CA made here, a server certificate
for 127.0.0.1 (and localhost) it signed, a client certificate for mutual TLS. Made with `cryptography` where it is
installed, else with openssl's CLI; each valid one day.

    write_certificates(folder)  # folder/{ca,server,client}.{crt,key}
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from pathlib import Path


def write_certificates(folder: Path) -> None:
    """ca.crt/.key, server.crt/.key (127.0.0.1, localhost; serverAuth) and client.crt/.key (clientAuth) in folder."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _certificates_with_openssl(folder)
    else:
        _certificates_with_cryptography(folder)


def _certificates_with_cryptography(folder: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, key, cert) -> None:
        (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
        (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def certificate(subject: str, key, issuer_name, issuer_key, ca: bool, extensions=()):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln test CA")])
    ca = certificate("kiln test CA", ca_key, ca_name, ca_key, True,
                     [x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                                    encipher_only=False, decipher_only=False)])
    write("ca", ca_key, ca)
    server_key = ec.generate_private_key(ec.SECP256R1())
    write("server", server_key, certificate("127.0.0.1", server_key, ca_name, ca_key, False, [
        x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])]))
    client_key = ec.generate_private_key(ec.SECP256R1())
    write("client", client_key, certificate("kiln test client", client_key, ca_name, ca_key, False,
                                            [x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])]))


def _certificates_with_openssl(folder: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
        "-subj", "/CN=kiln test CA", "-keyout", "ca.key", "-out", "ca.crt")
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject in (("server", "/CN=127.0.0.1"), ("client", "/CN=kiln test client")):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject,
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
            "-extfile", f"{name}.ext", "-out", f"{name}.crt")
