"""The SuperLink's Control API, closed to everyone but the operator (docs/security.md).

Flower 1.42 serves its Fleet API (SuperNodes), Control API (`flwr run`, `flwr ls`, `flwr stop`,
`flwr supernode register`) and Runtime API (the ServerApp's) on one port. The Control API asks an
account-authentication plugin (`flwr.superlink.auth_plugin.ControlAuthnPlugin`) about every
request's bearer token; the open-source build ships only the no-op plugin, which admits anyone
who can reach the port. `OperatorTokenAuthn` is that interface's smallest real implementation:
one random operator token, written by `fedmvp serve` into its own folder (mode 0600) and handed
to the SuperLink process by path, admits a request only when its ``Authorization: Bearer`` header
carries exactly that token. Node keys, the CA certificate and guesses are refused alike.

The `flwr` CLI that `serve` runs sends the token through Flower's own credential store and
interceptor (``FLWR_HOME/credentials.yaml``, the entries `flwr login` would write for an OIDC
SuperLink), so no Flower code is replaced on the client side.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from flwr.common.constant import ACCESS_TOKEN_KEY, NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, AuthnType
from flwr.supercore.auth.typing import AccountAuthCredentials, AccountAuthLoginDetails, AccountInfo
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.superlink.auth_plugin import ControlAuthnPlugin

from fedmvp_formats.atomic import write_bytes

TOKEN_FILE_ENV = "FEDMVP_OPERATOR_TOKEN_FILE"  # where the SuperLink process reads the token from


def _operator() -> AccountInfo:
    """The operator is the open-source federation's one account (Flower's no-op federation manager
    knows no other); a fresh record per request, as Flower's own no-op plugin makes."""
    return AccountInfo(flwr_aid=NOOP_FLWR_AID, account_name=NOOP_ACCOUNT_NAME)

_MIN_TOKEN_CHARS = 32


class OperatorTokenError(RuntimeError):
    """No usable operator token: the SuperLink must not start with an open Control API."""


def write_operator_token(path: Path) -> str:
    """A fresh random token, written owner-only (0600) and renamed into place; returns it."""
    token = secrets.token_urlsafe(32)
    write_bytes(path, token.encode("ascii"), mode=0o600)
    return token


def read_operator_token(path: str | os.PathLike | None) -> str:
    """The token in ``path``; refuses a missing, short or group/world-readable file (fail closed)."""
    if not path:
        raise OperatorTokenError(f"{TOKEN_FILE_ENV} is not set: refusing to start a SuperLink whose Control API "
                                 "anyone could use")
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as err:
        raise OperatorTokenError(f"{path}: cannot read the operator token ({err.strerror or err})") from None
    if mode & 0o077:
        raise OperatorTokenError(f"{path}: the operator token is readable by others (mode {mode & 0o777:o}); "
                                 "it must be 0600")
    if len(token) < _MIN_TOKEN_CHARS:
        raise OperatorTokenError(f"{path}: the operator token is shorter than {_MIN_TOKEN_CHARS} characters")
    return token


class OperatorTokenAuthn(ControlAuthnPlugin):
    """Flower's Control API authentication plugin, admitting only the holder of one operator token."""

    def __init__(self, token: str | None = None) -> None:
        self._token = (token if token is not None else read_operator_token(os.environ.get(TOKEN_FILE_ENV))).encode()

    def _valid(self, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        given = [value for key, value in metadata if key == ACCESS_TOKEN_KEY]
        if len(given) != 1:
            return False
        value = given[0].encode() if isinstance(given[0], str) else given[0]
        return hmac.compare_digest(value, self._token)

    def get_login_details(self) -> AccountAuthLoginDetails | None:
        """`flwr login` is not a way in: the no-op login type makes the CLI refuse to log in."""
        return AccountAuthLoginDetails(authn_type=AuthnType.NOOP, device_code="", verification_uri_complete="",
                                       expires_in=0, interval=0)

    def validate_tokens_in_metadata(self, metadata: Sequence[tuple[str, str | bytes]]
                                    ) -> tuple[bool, AccountInfo | None]:
        """Valid only with exactly one bearer token equal to the operator's (constant-time compare)."""
        return (True, _operator()) if self._valid(metadata) else (False, None)

    def get_auth_tokens(self, device_code: str) -> AccountAuthCredentials | None:
        """No device flow: tokens are never handed out over the network."""
        raise FlowerError(ApiErrorCode.NO_ACCOUNT_AUTH, "This SuperLink admits only its operator.")

    def refresh_tokens(self, metadata: Sequence[tuple[str, str | bytes]]
                       ) -> tuple[Sequence[tuple[str, str | bytes]] | None, AccountInfo | None]:
        """Nothing to refresh: the operator token does not expire while `serve` runs."""
        return (metadata, _operator()) if self._valid(metadata) else (None, None)


def store_cli_credentials(flwr_home: Path, address: str, token: str) -> None:
    """Make the `flwr` CLI of ``flwr_home`` send ``token`` to ``address`` (Flower's own credential store)."""
    from flwr.cli.constant import ACCESS_TOKEN_STORE_KEY, AUTHN_TYPE_STORE_KEY, REFRESH_TOKEN_STORE_KEY
    from flwr.supercore.credential_store.file_credential_store import FileCredentialStore

    store = FileCredentialStore(flwr_home / "credentials.yaml")
    store.set(AUTHN_TYPE_STORE_KEY % address, AuthnType.OIDC.encode())
    store.set(ACCESS_TOKEN_STORE_KEY % address, token.encode())
    store.set(REFRESH_TOKEN_STORE_KEY % address, token.encode())
    os.chmod(flwr_home / "credentials.yaml", 0o600)
