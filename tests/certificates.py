"""Certificates for the tests' TLS servers, made with `cryptography`: a certificate
authority and the server and client certificates it signs."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, key_path: str) -> None:
    with open(key_path, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


class CertificateAuthority:
    """A self-signed CA certificate valid for a week; with `hosts` it is also a server
    certificate for those names (the TLS server presents the CA itself)."""

    def __init__(self, common_name: str, hosts: tuple[str, ...] = ()) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(common_name)
        builder = self._builder(self.name, self.key.public_key(), hosts)
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
        self.certificate = builder.sign(self.key, hashes.SHA256())

    def _builder(self, subject: x509.Name, public_key, hosts: tuple[str, ...]):
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
        )
        if hosts:
            names = [x509.DNSName(host) for host in hosts]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder

    def write(self, cert_path: str, key_path: str | None = None) -> None:
        """The CA certificate (what a client trusts) and, if asked, its key."""
        with open(cert_path, "wb") as out:
            out.write(self.certificate.public_bytes(serialization.Encoding.PEM))
        if key_path:
            _write_key(self.key, key_path)

    def issue(
        self, cert_path: str, key_path: str, common_name: str, hosts: tuple[str, ...] = ()
    ) -> None:
        """Writes a certificate it signs and its key: a server's for `hosts`, else a
        client's (named `common_name`)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if hosts else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = self._builder(_name(common_name), key.public_key(), hosts)
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        with open(cert_path, "wb") as out:
            out.write(certificate.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
