"""The local cluster's PKI, written as PEM files into one folder.

- ``ca``: signs the API server's serving certificate and every client certificate;
- ``front-proxy-ca``: signs only ``front-proxy-client``, the identity the API server uses towards
  aggregated API servers (kept apart from ``ca`` so that an ordinary client certificate can never
  pass as the front proxy and assert arbitrary users through request headers);
- ``sa.key``/``sa.pub``: the ServiceAccount token signing pair.

``generate_serving_pair`` makes a separate CA and serving certificate for a server the API server
calls (an aggregated API server registered through an APIService, a webhook).

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
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

CA_NAME = "davit-local-ca"
FRONT_PROXY_CA_NAME = "davit-front-proxy-ca"
FRONT_PROXY_CLIENT = "front-proxy-client"
# Names a client or the API server's own in-cluster endpoint may use to reach it.
SERVING_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
CA_DAYS = 3650
LEAF_DAYS = 365


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
    def front_proxy_ca_cert(self) -> Path:
        return self.dir / "front-proxy-ca.crt"

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


class _Backend(Protocol):
    def make_ca(self, stem: str, common_name: str) -> None: ...

    def issue(
        self,
        ca_stem: str,
        stem: str,
        common_name: str,
        groups: tuple[str, ...],
        server_names: tuple[list[str], list[str]] | None,
    ) -> None:
        """Signs ``stem``.crt with ``ca_stem``; a serving certificate when ``server_names``
        (DNS names, IP addresses) is given, else a client certificate."""

    def key_pair(self, stem: str) -> None:
        """Writes ``stem``.key and its public key as ``stem``.pub."""


def generate_pki(
    directory: Path,
    clients: list[ClientIdentity],
    serving_ips: list[str],
    backend: Literal["cryptography", "openssl"] | None = None,
) -> Pki:
    """Writes fresh CAs and everything signed by them into ``directory`` (created if missing).

    ``backend`` None picks ``cryptography`` when importable, else the openssl command line.
    """
    directory.mkdir(parents=True, exist_ok=True)
    impl = _backend(directory, backend)
    impl.make_ca("ca", CA_NAME)
    impl.make_ca("front-proxy-ca", FRONT_PROXY_CA_NAME)
    impl.issue("ca", "apiserver", "kube-apiserver", (), (list(SERVING_DNS), serving_ips))
    for client in clients:
        impl.issue("ca", client.file_stem, client.user, client.groups, None)
    impl.issue("front-proxy-ca", FRONT_PROXY_CLIENT, FRONT_PROXY_CLIENT, (), None)
    impl.key_pair("sa")
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return Pki(directory)


@dataclass(frozen=True)
class ServingPair:
    """A serving certificate, its key and the CA that signed it (all PEM paths)."""

    ca_cert: Path
    cert: Path
    key: Path


def generate_serving_pair(
    directory: Path,
    stem: str,
    dns_names: list[str],
    ips: list[str],
    backend: Literal["cryptography", "openssl"] | None = None,
) -> ServingPair:
    """A CA of its own and a serving certificate it signs, for a server the API server calls
    (an aggregated API server or a webhook: their registration carries the CA as ``caBundle``).

    Writes ``stem``-ca.crt/.key and ``stem``.crt/.key into ``directory``; the CA is apart from the
    cluster's so that nothing it signs is trusted as a cluster client.
    """
    directory.mkdir(parents=True, exist_ok=True)
    impl = _backend(directory, backend)
    impl.make_ca(f"{stem}-ca", f"{stem}-ca")
    impl.issue(f"{stem}-ca", stem, stem, (), (list(dns_names), list(ips)))
    for key in directory.glob(f"{stem}*.key"):
        key.chmod(0o600)
    return ServingPair(
        directory / f"{stem}-ca.crt", directory / f"{stem}.crt", directory / f"{stem}.key"
    )


def _backend(directory: Path, backend: Literal["cryptography", "openssl"] | None) -> _Backend:
    if backend is None:
        backend = "cryptography" if importlib.util.find_spec("cryptography") else "openssl"
    if backend == "openssl" and shutil.which("openssl") is None:
        raise RuntimeError(
            "cannot create certificates: install the Python package `cryptography` "
            "(pip install cryptography) or the openssl command line"
        )
    return _Cryptography(directory) if backend == "cryptography" else _OpenSsl(directory)


class _Cryptography:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.now = datetime.datetime.now(datetime.UTC)
        # Backdated so small clock differences never make a fresh certificate "not yet valid".
        self.not_before = self.now - datetime.timedelta(hours=1)

    def _new_key(self, stem: str) -> ec.EllipticCurvePrivateKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        (self.dir / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return key

    def _load_ca(self, stem: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = serialization.load_pem_private_key((self.dir / f"{stem}.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise RuntimeError(f"{self.dir / stem}.key is not an EC key")
        cert = x509.load_pem_x509_certificate((self.dir / f"{stem}.crt").read_bytes())
        return key, cert

    @staticmethod
    def _key_usage(*, ca: bool) -> x509.KeyUsage:
        from cryptography import x509

        return x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=ca,
            crl_sign=ca,
            encipher_only=False,
            decipher_only=False,
        )

    def make_ca(self, stem: str, common_name: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import NameOID

        key = self._new_key(stem)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usage = self._key_usage(ca=True)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before)
            .not_valid_after(self.now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        (self.dir / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        ca_stem: str,
        stem: str,
        common_name: str,
        groups: tuple[str, ...],
        server_names: tuple[list[str], list[str]] | None,
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_key, ca_cert = self._load_ca(ca_stem)
        key = self._new_key(stem)
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usage = self._key_usage(ca=False)
        purpose = (
            ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before)
            .not_valid_after(self.now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if server_names:
            dns, ips = server_names
            san: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        (self.dir / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def key_pair(self, stem: str) -> None:
        from cryptography.hazmat.primitives import serialization

        key = self._new_key(stem)
        (self.dir / f"{stem}.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


class _OpenSsl:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def _run(self, *args: str) -> None:
        result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")

    def _new_key(self, stem: str) -> Path:
        path = self.dir / f"{stem}.key"
        self._run(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
        )
        return path

    def make_ca(self, stem: str, common_name: str) -> None:
        key = self._new_key(stem)
        self._run(
            "req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={common_name}",
            "-days", str(CA_DAYS), "-out", str(self.dir / f"{stem}.crt"),
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign",
        )  # fmt: skip

    def issue(
        self,
        ca_stem: str,
        stem: str,
        common_name: str,
        groups: tuple[str, ...],
        server_names: tuple[list[str], list[str]] | None,
    ) -> None:
        key = self._new_key(stem)
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={common_name}"
        extensions = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        if server_names:
            dns, ips = server_names
            alt = [f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ips]
            extensions += "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(alt) + "\n"
        else:
            extensions += "extendedKeyUsage=clientAuth\n"
        with tempfile.TemporaryDirectory() as tmp:
            csr, ext = Path(tmp) / "req.csr", Path(tmp) / "ext.cnf"
            ext.write_text(extensions)
            self._run("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
            self._run(
                "x509", "-req", "-in", str(csr),
                "-CA", str(self.dir / f"{ca_stem}.crt"), "-CAkey", str(self.dir / f"{ca_stem}.key"),
                "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(LEAF_DAYS), "-sha256",
                "-extfile", str(ext), "-out", str(self.dir / f"{stem}.crt"),
            )  # fmt: skip

    def key_pair(self, stem: str) -> None:
        key = self._new_key(stem)
        self._run("pkey", "-in", str(key), "-pubout", "-out", str(self.dir / f"{stem}.pub"))
