"""The data plane's keys: a MAC key for manifests, and a TLS identity for the stream link.

They live beside the CURVE keys, in the directory ``DELTARL_CURVE_KEYS`` names (``deltarl
keys DIR`` makes both), so the data plane is authenticated whenever the control plane is:

    data.key                 32 random bytes (hex): the key of every manifest's MAC (keyed
                             BLAKE2b, deltarl/codecs/manifest_seal.py). Every export and
                             apply agent holds it; a manifest that does not carry its MAC is
                             never activated, whichever link brought it
    tls/ca.crt               the cluster's certificate authority. Its private key signed
                             node.crt and was then thrown away: nobody can add an identity,
                             so a new one means a new directory for the whole cluster
    tls/node.crt, node.key   the identity both ends of a stream link present (TLS 1.3,
                             mutual: each end refuses a peer whose certificate the cluster's
                             CA did not sign)

The secret files are 0600 and the directory 0700; ``load`` refuses a secret group or
others may read. Host names are not checked (agents are addressed by IP, and every agent
holds the same identity): what a peer proves is that it holds the cluster's key directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from deltarl.config.errors import ConfigError

KEYS_ENV = "DELTARL_CURVE_KEYS"
MAC_KEY_BYTES = 32
CERT_DAYS = 3650


class DataKeyError(ConfigError):
    """The key directory lacks a data-plane key, or holds one that cannot be trusted."""


@dataclass(frozen=True)
class DataKeys:
    directory: Path
    mac_key: bytes

    @property
    def ca(self) -> Path:
        return self.directory / "tls" / "ca.crt"

    @property
    def cert(self) -> Path:
        return self.directory / "tls" / "node.crt"

    @property
    def key(self) -> Path:
        return self.directory / "tls" / "node.key"

    @classmethod
    def load(cls, directory: str | Path) -> DataKeys:
        d = Path(directory)
        hint = f"(add them with `deltarl keys {d}`, then copy the directory to every host)"
        path = d / "data.key"
        try:
            st = os.stat(path)
            text = path.read_text().strip()
        except OSError as e:
            raise DataKeyError(f"{KEYS_ENV}={d}: no data-plane key: {e} {hint}") from None
        _check_secret(st, path)
        try:
            mac_key = bytes.fromhex(text)
        except ValueError:
            raise DataKeyError(f"{path} is not hex") from None
        if len(mac_key) != MAC_KEY_BYTES:
            raise DataKeyError(f"{path} holds {len(mac_key)} bytes, not {MAC_KEY_BYTES}")
        keys = cls(d, mac_key)
        for p in (keys.ca, keys.cert, keys.key):
            if not p.is_file():
                raise DataKeyError(f"{KEYS_ENV}={d}: {p} is missing {hint}")
        _check_secret(os.stat(keys.key), keys.key)
        return keys

    @classmethod
    def from_env(cls) -> DataKeys | None:
        value = os.environ.get(KEYS_ENV)
        return cls.load(value) if value else None

    def server_context(self) -> ssl.SSLContext:
        """TLS 1.3 for a stream receiver: present node.crt, require a CA-signed client."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        return self._finish(ctx)

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.3 for a stream sender: present node.crt, require a CA-signed server."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # see the module docstring: the CA is the identity
        return self._finish(ctx)

    def _finish(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=str(self.ca))
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as e:
            raise DataKeyError(f"{KEYS_ENV}={self.directory}: TLS identity unusable: {e}") from e
        return ctx


def _check_secret(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise DataKeyError(
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}; refused: a "
            f"secret must belong to this user (uid {os.geteuid()}) with mode 0600"
        )


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_data_keys(directory: str | Path) -> list[Path]:
    """Add what the directory lacks of the data-plane keys; return the files written."""
    d = Path(directory)
    written: list[Path] = []
    if not (d / "data.key").exists():
        _write_secret(d / "data.key", secrets.token_hex(MAC_KEY_BYTES).encode() + b"\n")
        written.append(d / "data.key")
    tls = d / "tls"
    if not (tls / "node.key").exists():
        tls.mkdir(mode=0o700, exist_ok=True)
        ca_pem, cert_pem, key_pem = _issue_identity()
        (tls / "ca.crt").write_bytes(ca_pem)
        (tls / "node.crt").write_bytes(cert_pem)
        _write_secret(tls / "node.key", key_pem)
        written += [tls / "ca.crt", tls / "node.crt", tls / "node.key"]
    return written


def _issue_identity() -> tuple[bytes, bytes, bytes]:
    """A fresh CA certificate, a node certificate it signed, the node's key (PEM). The CA's
    key exists only in this function."""
    from cryptography import x509  # noqa: PLC0415 - only `deltarl keys` makes certificates
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415

    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=CERT_DAYS)
    tag = secrets.token_hex(4)  # tells one cluster's certificates from another's in logs
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"deltarl cluster CA {tag}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"deltarl node {tag}")]))
        .issuer_name(ca_name)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = node_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca.public_bytes(pem), node.public_bytes(pem), key_pem


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this host's loopback: the only place an
    unauthenticated data link is allowed by default."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def link_keys(owner: str, host: str, security: str) -> DataKeys | None:
    """The keys a data link to or at ``host`` uses under its ``security`` setting; None:
    unauthenticated. ``auto`` (the default) authenticates whenever keys are configured, and
    refuses to run unauthenticated beyond loopback; ``on`` requires keys; ``off`` never
    authenticates (an operator's explicit choice, for a network trusted otherwise)."""
    if security == "off":
        return None
    keys = DataKeys.from_env()
    if keys is not None:
        return keys
    if security == "on":
        raise DataKeyError(f"{owner}: security = 'on' but {KEYS_ENV} is not set")
    if not is_loopback(host):
        raise DataKeyError(
            f"{owner}: host {host!r} is not loopback, and the data plane would be "
            f"unauthenticated: set {KEYS_ENV} to a key directory (`deltarl keys DIR`), or "
            f"set security = 'off' in the link table if this network is trusted otherwise"
        )
    return None
