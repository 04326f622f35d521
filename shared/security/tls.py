"""A private CA and a server certificate, generated on the fly (PEM), for the development
broker and the stack's init service.

Guarantees: the CA key never leaves ``directory`` (mode 0600); the server certificate is
signed by the CA, valid for ``days`` from ``now`` (passed in), and names every host in
``hosts`` (IP addresses as IP SANs, the rest as DNS SANs) so clients verify the hostname.
``server.pem`` holds the server's PKCS#8 key followed by its certificate and the CA's, the
form Kafka's ``ssl.keystore.type=PEM`` reads.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.security.files import write_private

__all__ = ["TlsFiles", "make_tls"]


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """Where :func:`make_tls` put its files."""

    ca_cert: Path
    ca_key: Path
    server_pem: Path


def make_tls(directory: Path, *, hosts: tuple[str, ...], now: dt.datetime, days: int = 365,
             common_name: str = "hadar kafka") -> TlsFiles:
    """A new CA and a server certificate for ``hosts`` in ``directory``; see the module doc."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hadar development CA")])
    not_after = now + dt.timedelta(days=days)
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = TlsFiles(ca_cert=directory / "ca.pem", ca_key=directory / "ca.key", server_pem=directory / "server.pem")
    pem = serialization.Encoding.PEM
    files.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    files.ca_cert.chmod(0o644)
    write_private(files.ca_key, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()).decode())
    write_private(files.server_pem, (key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption())
                                     + cert.public_bytes(pem) + ca_cert.public_bytes(pem)).decode())
    return files
