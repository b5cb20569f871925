"""A listed site's name bound to its SuperNode key: the site proves it holds that key (docs/security.md).

Flower's SuperNode authentication admits any key of ``fedmvp serve --node-keys``, and the ServerApp's
Grid does not say which key a node used (the SuperLink keeps it, behind its Control API). So where a
preset's ``[[sites]]`` table names ``node_key = "keys/north.pub"`` (the site's OpenSSH public key,
relative to the preset file), a node claiming that site must prove it holds the matching private key:
each identify message carries a fresh server nonce (``PROOF_REQUEST``), and the node's ClientApp signs
its identity (run id, round, its node id, its site name, the nonce; ``payload``) with the key file
`fedmvp join --auth-key` gave its SuperNode (node config ``auth-key``). The server checks the signature
with the site's listed key before anything from the node is used; a node that cannot prove it is sent
no work (``sampling.NodeRegistry``), with one line naming the site and why. A signature of another
round, run, node or nonce does not verify. Binding holds in a deployment only (`fedmvp serve`); the
simulation's nodes are the server's own processes.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedmvp_formats.nofollow import read_nofollow
from fedmvp_formats.shown import name_shown, shown

KEY_BYTES = 1 << 14  # an OpenSSH public key line is under 1 KiB; more is not a key
PROOF_REQUEST = "site-proof-request"  # the identify message's record holding the server's nonce
NONCE = "nonce"
PROOF = "site-proof"  # the identify reply's identity key: the signature, base64
AUTH_KEY = "auth-key"  # the node config key naming the SuperNode's private key file (fedmvp join --auth-key)
PURPOSE = "fedmvp-site-proof/1"
MAX_PROOF = 512  # characters: a P-384 DER signature is at most ~140 in base64


class SiteKeyError(ValueError):
    """A site's node_key (server) or auth-key (site) that cannot be used; one line naming the file."""


def payload(run_id: str, round_number: int, node: int, name: str, nonce: str) -> bytes:
    """The bytes a site signs: what binds the proof to this run, round, node, site and request."""
    return json.dumps({"purpose": PURPOSE, "run_id": run_id, "round": round_number, "node": int(node),
                       "site": name, "nonce": nonce}, sort_keys=True).encode()


def new_nonce() -> str:
    return secrets.token_hex(16)


def load_public(path: Path) -> ec.EllipticCurvePublicKey:
    """A site's listed public key (OpenSSH ``ecdsa-sha2-nistp384 ...``, as `fedmvp certs --nodes` writes)."""
    try:
        key = serialization.load_ssh_public_key(read_nofollow(path, KEY_BYTES, follow_links=True).strip())
    except OSError as err:
        raise SiteKeyError(f"{name_shown(str(path))}: cannot read the site's node_key ({err.strerror or err})") from None
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise SiteKeyError(f"{name_shown(str(path))}: node_key is not an OpenSSH public key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise SiteKeyError(f"{name_shown(str(path))}: node_key is not an ECDSA key (what Flower's SuperNode auth uses)")
    return key


def sign(key_file: str | Path, data: bytes) -> str:
    """``data`` signed with the SuperNode's private key file (OpenSSH or PEM), base64."""
    raw = Path(key_file).read_bytes()
    try:
        key = serialization.load_ssh_private_key(raw, None) if raw.lstrip().startswith(b"-----BEGIN OPENSSH") \
            else serialization.load_pem_private_key(raw, None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise SiteKeyError(f"{name_shown(str(key_file))}: not a private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SiteKeyError(f"{name_shown(str(key_file))}: not an ECDSA private key")
    return base64.b64encode(key.sign(data, ec.ECDSA(hashes.SHA384()))).decode()


def verifies(key: ec.EllipticCurvePublicKey, proof: str, data: bytes) -> bool:
    try:
        key.verify(base64.b64decode(proof, validate=True), data, ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class SiteKeys:
    """The listed sites' keys: site id -> (the file as the preset names it, its public key). A site with
    no ``node_key`` is unbound (any admitted node may claim it, as before)."""

    keys: dict[int, tuple[str, ec.EllipticCurvePublicKey]]
    names: dict[int, str]

    @classmethod
    def from_preset(cls, preset) -> "SiteKeys | None":
        """The keys a [federation] preset's [[sites]] name (None: none named), each read and checked."""
        keys = {i: (s.node_key, load_public(s.node_key_path())) for i, s in enumerate(preset.sites) if s.node_key}
        return cls(keys, {i: s.name for i, s in enumerate(preset.sites)}) if keys else None

    def problem(self, site: int, name: str | None, proof: object, data: bytes) -> str | None:
        """Why the node claiming ``site`` did not prove its key (None: it did, or the site is unbound)."""
        if site not in self.keys:
            return None
        file, key = self.keys[site]
        head = f"site {site} {shown(name)} is bound to node_key {name_shown(file)}"
        if proof is None:
            return f"{head}; this node sent no proof of it (start it with fedmvp join --auth-key, the site's private key)"
        if not isinstance(proof, str) or len(proof) > MAX_PROOF:
            return f"{head}; this node's proof {shown(proof, 40)} is no signature"
        if verifies(key, proof, data):
            return None
        other = next((i for i, (_, k) in self.keys.items() if i != site and verifies(k, proof, data)), None)
        if other is not None:
            return f"{head}; this node holds the key of site {other} {shown(self.names.get(other))}"
        return f"{head}; this node's proof does not verify with it (another key, or a proof of another request)"
