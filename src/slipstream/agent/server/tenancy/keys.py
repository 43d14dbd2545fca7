"""API keys: how they are made, stored and read off a request.

    slipstream tenants new-key --> a random key (shown once) and its digest (into the file)
    request headers --bearer_token()--> the presented key --key_digest()--> registry lookup

Keys are stored as SHA-256 digests, not with a slow password hash (bcrypt, scrypt, argon2).
A slow hash protects *low-entropy* secrets that people choose; these keys are 256-bit random
strings that the helper generates, so recovering one from its digest is a 2^256 search
whatever the hash, and a slow hash would only add tens of milliseconds of CPU to every
request (or force a plaintext cache in memory). A plain digest also lets the registry find
the tenant with one dictionary lookup, instead of trying every stored hash. The helper
refuses to hash an operator-chosen key shorter than ``MIN_KEY_CHARS``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

KEY_PREFIX = "sk-slip-"
MIN_KEY_CHARS = 32
MAX_KEY_CHARS = 256  # a longer Authorization value is malformed, never hashed
DIGEST_HEX_CHARS = 64
# Query parameters that would carry a credential in the URL, where proxies and access logs
# keep it: such a request is refused even when its header is right.
CREDENTIAL_QUERY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token",
                                     "access_token", "authorization"})
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


class KeyProblem(Exception):
    """The request's credentials cannot be read; ``missing`` when none were sent."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def new_key() -> str:
    """A fresh key: the prefix and 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_key_strength(key: str) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"an API key needs at least {MIN_KEY_CHARS} characters of randomness "
                         f"(got {len(key)}); `slipstream tenants new-key` makes one")
    if len(key) > MAX_KEY_CHARS or not set(key) <= _KEY_CHARS:
        raise ValueError(f"an API key is at most {MAX_KEY_CHARS} characters of "
                         "[A-Za-z0-9-._~+/=]")


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The key of ``Authorization: Bearer <key>`` among raw ASGI headers (names are
    lower-case there; the scheme is matched without case, as RFC 9110 says). Exactly one
    Authorization header: two are refused rather than guessed between."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if not values:
        raise KeyProblem("You didn't provide an API key. Send it in an Authorization header "
                         "using Bearer auth (Authorization: Bearer YOUR_KEY).", missing=True)
    if len(values) > 1:
        raise KeyProblem("Send exactly one Authorization header.")
    raw = values[0]
    if len(raw) > len("Bearer ") + MAX_KEY_CHARS:
        raise KeyProblem("Malformed Authorization header: the key is too long.")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise KeyProblem("Malformed Authorization header: not ASCII.") from None
    scheme, _, token = text.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise KeyProblem("Malformed Authorization header: expected 'Bearer YOUR_KEY'.")
    if not set(token) <= _KEY_CHARS:
        raise KeyProblem("Malformed Authorization header: the key has characters no key has.")
    return token


def credential_in_query(query_string: bytes) -> str | None:
    """The name of a credential-looking query parameter, if the URL carries one."""
    for pair in query_string.split(b"&"):
        name = pair.split(b"=", 1)[0].decode("latin-1").lower()
        if name in CREDENTIAL_QUERY_PARAMS:
            return name
    return None
