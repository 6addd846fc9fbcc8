"""The local cluster's PKI: a CA, the API server's serving certificate, client certificates and the
service-account signing key pair, written as PEM files into one folder.

ECDSA P-256 keys keep generation in the milliseconds. The ``cryptography`` package is used when it
is importable; otherwise the ``openssl`` command line produces the same files.
"""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CA_NAME = "davit-local-ca"
# Names a client or the API server's own in-cluster endpoint may use to reach it.
SERVING_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's user (CN) and groups (O)."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pki:
    """Paths of the generated files (all PEM)."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_private_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_public_key(self) -> Path:
        return self.dir / "sa.pub"

    def client_cert(self, stem: str) -> Path:
        return self.dir / f"{stem}.crt"

    def client_key(self, stem: str) -> Path:
        return self.dir / f"{stem}.key"


def generate_pki(
    directory: Path,
    clients: list[ClientIdentity],
    serving_ips: list[str],
    backend: Literal["cryptography", "openssl"] | None = None,
) -> Pki:
    """Writes a fresh CA and everything signed by it into ``directory`` (created if missing).

    ``backend`` None picks ``cryptography`` when importable, else the openssl command line.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    if backend is None:
        backend = "cryptography" if importlib.util.find_spec("cryptography") else "openssl"
    if backend == "cryptography":
        _generate_with_cryptography(pki, clients, serving_ips)
    else:
        if shutil.which("openssl") is None:
            raise RuntimeError(
                "cannot create certificates: install the Python package `cryptography` "
                "(pip install cryptography) or the openssl command line"
            )
        _generate_with_openssl(pki, clients, serving_ips)
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return pki


def _generate_with_cryptography(
    pki: Pki, clients: list[ClientIdentity], serving_ips: list[str]
) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    # Backdated so small clock differences never make a fresh certificate "not yet valid".
    not_before = now - datetime.timedelta(hours=1)

    def new_key(path: Path) -> ec.EllipticCurvePrivateKey:
        key = ec.generate_private_key(ec.SECP256R1())
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return key

    def name(common_name: str, groups: tuple[str, ...] = ()) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        return x509.Name(attrs)

    ca_key = new_key(pki.ca_key)
    ca_name = name(CA_NAME)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        cert_path: Path,
        key_path: Path,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        san: x509.SubjectAlternativeName | None,
    ) -> None:
        key = new_key(key_path)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    san = x509.SubjectAlternativeName(
        [x509.DNSName(d) for d in SERVING_DNS]
        + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in serving_ips]
    )
    issue(
        pki.serving_cert,
        pki.serving_key,
        name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        san,
    )
    for client in clients:
        issue(
            pki.client_cert(client.file_stem),
            pki.client_key(client.file_stem),
            name(client.user, client.groups),
            ExtendedKeyUsageOID.CLIENT_AUTH,
            None,
        )

    sa_key = new_key(pki.sa_private_key)
    pki.sa_public_key.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _generate_with_openssl(pki: Pki, clients: list[ClientIdentity], serving_ips: list[str]) -> None:
    def new_key(path: Path) -> None:
        _openssl(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
        )

    new_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-subj", f"/CN={CA_NAME}",
        "-days", "3650", "-out", str(pki.ca_cert),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign",
    )  # fmt: skip

    def issue(cert: Path, key: Path, subject: str, extensions: str) -> None:
        new_key(key)
        with tempfile.TemporaryDirectory() as tmp:
            csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
            ext.write_text(extensions)
            _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
            _openssl(
                "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert),
                "-CAkey", str(pki.ca_key), "-set_serial", f"0x{_random_serial()}",
                "-days", "365", "-sha256", "-extfile", str(ext), "-out", str(cert),
            )  # fmt: skip

    base = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    alt_names = [f"DNS:{d}" for d in SERVING_DNS] + [f"IP:{ip}" for ip in serving_ips]
    issue(
        pki.serving_cert,
        pki.serving_key,
        "/CN=kube-apiserver",
        base + "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(alt_names) + "\n",
    )
    for client in clients:
        subject = "".join(f"/O={g}" for g in client.groups) + f"/CN={client.user}"
        issue(
            pki.client_cert(client.file_stem),
            pki.client_key(client.file_stem),
            subject,
            base + "extendedKeyUsage=clientAuth\n",
        )
    new_key(pki.sa_private_key)
    _openssl("pkey", "-in", str(pki.sa_private_key), "-pubout", "-out", str(pki.sa_public_key))


def _random_serial() -> str:
    return secrets.token_hex(16)
