"""Certificates and SuperNode keys for a trial or a small federation (`fedmvp certs`).

Writes, with the ``cryptography`` package:
- ``ca.key`` / ``ca.crt``: a private certificate authority (every machine trusts ``ca.crt``);
- ``server.key`` / ``server.pem``: the SuperLink's TLS certificate, signed by the CA, valid for the
  given host names and IP addresses (``--host``; 127.0.0.1 and localhost always);
- with ``nodes``: ``node-N`` / ``node-N.pub`` key pairs (ECDSA P-384, OpenSSH format, what Flower's
  SuperNode authentication reads) and ``node-keys.txt``, the public keys the SuperLink admits.
Private keys are written 0600. Production sites bring certificates from their own CA instead
(docs/tutorials/across-machines.md says which files go where).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedmvp_formats.atomic import write_bytes

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
VALID_DAYS = 365
NODE_KEYS = "node-keys.txt"


class CertsError(ValueError):
    """A certificate request that cannot be fulfilled; one line."""


@dataclass
class CertFiles:
    """What was written, by role."""

    out: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    hosts: list[str]
    node_keys: list[tuple[Path, Path]] = field(default_factory=list)  # (private, public)
    node_list: Path | None = None

    def to_json(self) -> dict:
        return {"out": str(self.out), "ca": str(self.ca_cert), "server_cert": str(self.server_cert),
                "server_key": str(self.server_key), "hosts": self.hosts,
                "nodes": [{"private": str(a), "public": str(b)} for a, b in self.node_keys],
                "node_keys": str(self.node_list) if self.node_list else None}


def _write(path: Path, data: bytes, private: bool) -> Path:
    """Written atomically (whole, fsynced, renamed), private keys readable by the owner only."""
    return write_bytes(path, data, mode=0o600 if private else 0o644)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, ca: bool, hosts: list[str] | None = None) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = (builder.add_extension(_san(hosts or []), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(signer, hashes.SHA256())


def write_certs(out: str | os.PathLike, hosts: list[str] | tuple[str, ...] = (), nodes: int = 0,
                force: bool = False) -> CertFiles:
    """A CA, a server certificate for ``hosts`` (plus localhost/127.0.0.1) and ``nodes`` SuperNode keys."""
    out = Path(out)
    names = list(dict.fromkeys([*hosts, *DEFAULT_HOSTS]))
    for host in names:
        if not host or any(c.isspace() for c in host):
            raise CertsError(f"--host {host!r}: not a host name or IP address")
    if nodes < 0:
        raise CertsError(f"--nodes must be >= 0, got {nodes}")
    if out.exists() and not out.is_dir():
        raise CertsError(f"{out}: exists and is not a directory")
    if out.is_dir() and (out / "ca.key").exists() and not force:
        raise CertsError(f"{out}: already holds a CA (ca.key); pass --force to replace every file")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedmvp federation CA")])
    ca_cert = _certificate("fedmvp federation CA", ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = _certificate(names[0], server_key, ca_name, ca_key, ca=False, hosts=names)
    files = CertFiles(
        out=out,
        ca_key=_write(out / "ca.key", _pem_key(ca_key), private=True),
        ca_cert=_write(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), private=False),
        server_key=_write(out / "server.key", _pem_key(server_key), private=True),
        server_cert=_write(out / "server.pem", server_cert.public_bytes(serialization.Encoding.PEM), private=False),
        hosts=names)
    public_lines = []
    for i in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        pair = (_write(out / f"node-{i}", private, private=True), _write(out / f"node-{i}.pub", public + b"\n",
                                                                       private=False))
        files.node_keys.append(pair)
        public_lines.append(public.decode())
    if nodes:
        files.node_list = _write(out / NODE_KEYS, ("\n".join(public_lines) + "\n").encode(), private=False)
    return files


def read_node_keys(path: str | os.PathLike) -> list[str]:
    """Public keys (OpenSSH lines) from a node-keys file; each is checked to be a NIST EC key."""
    path = Path(path)
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except OSError as err:
        raise CertsError(f"{path}: cannot read ({err.strerror or err})") from None
    keys = [ln for ln in lines if ln and not ln.startswith("#")]
    if not keys:
        raise CertsError(f"{path}: no public keys (one OpenSSH 'ecdsa-sha2-nistp384 ...' line per SuperNode)")
    for number, key in enumerate(keys, 1):
        try:
            loaded = serialization.load_ssh_public_key(key.encode())
        except (ValueError, TypeError) as err:
            raise CertsError(f"{path}: key {number} is not an OpenSSH public key ({err})") from None
        if not isinstance(loaded, ec.EllipticCurvePublicKey):
            raise CertsError(f"{path}: key {number} is not an ECDSA key (Flower's SuperNode auth needs one)")
    return keys
