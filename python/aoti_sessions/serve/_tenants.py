"""Tenants: each API key is one, and owns the sessions and session files it
makes; another key's are invisible to it (404, as if absent), so that one
client cannot list, read, fork or probe (``cached_tokens``) another's
conversation. A session id is the tenant's own: two keys may each have a
session ``chat-1``, two different sessions.

A tenant is known by a hash of its key, never the key itself (tenant ids
name folders of the session dir). The key of ``--api-key`` (or no key at
all) is the default tenant, whose files and parked sessions are the session
dir's own, as before there were tenants; each key of ``--api-keys`` keeps
them in ``SESSION_DIR/.tenants/ID``. Requests without a session id share
cached prefixes (llm/runtime/_prefix.py) within their key's namespace only
(:func:`cache_namespace`). Importing this needs nothing beyond the
standard library (the command line reads the keys file with it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable

DEFAULT_TENANT = ""  # the tenant of --api-key, or of every request where no key is asked for
TENANTS_DIR = ".tenants"  # in --session-dir: a folder for each key of --api-keys (a name no client's file can take)
_KEY = re.compile(r"[\x21-\x7e]+")  # what an Authorization header can carry as a token: visible ASCII, no spaces


def tenant_id(key: str) -> str:
    """The tenant of ``key``: a hash of it (32 hex digits), the same in every
    process and across restarts."""
    return hashlib.sha256(b"aoti-sessions tenant\0" + key.encode()).hexdigest()[:32]


def scoped(tenant: str, session_id: str) -> str:
    """A session's id as the server's table and the cluster's router know it:
    the client's id, within its tenant ('/' is in neither)."""
    return session_id if tenant == DEFAULT_TENANT else f"{tenant}/{session_id}"


def cache_namespace(tenant: str, key: str | None = None) -> str:
    """The prefix cache's namespace of a request of ``tenant`` that sent
    ``prompt_cache_key`` ``key`` (if any): requests share cached prefixes
    within one only (llm/runtime/_prefix.py), so never across keys (nor, within a
    key, across its clients' cache keys)."""
    return tenant if key is None else f"{tenant}\0{key}"  # (a tenant id holds no NUL: no two alike)


def read_api_keys(path: str | os.PathLike[str]) -> list[str]:
    """The keys of an ``--api-keys`` file: one a line, surrounding spaces
    stripped; empty lines and lines starting with ``#`` skipped. ValueError
    (naming the file and line) for a file that cannot be read, holds no key,
    a key with spaces or other characters a header cannot carry, or one key
    twice."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--api-keys {os.fspath(path)}: cannot read the keys file ({why})") from None
    keys: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not _KEY.fullmatch(key):
            raise ValueError(f"--api-keys {os.fspath(path)}, line {number}: a key is one word of visible ASCII "
                             "characters (no spaces inside)")
        if key in keys:
            raise ValueError(f"--api-keys {os.fspath(path)}, line {number}: the key of line {keys[key]} again "
                             "(each key is one tenant)")
        keys[key] = number
    if not keys:
        raise ValueError(f"--api-keys {os.fspath(path)}: no key in the file (one a line; '#' starts a comment)")
    return list(keys)


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The KEY of a request's (lower-case) ``Authorization: Bearer KEY``
    header; None without one. The scheme is case-insensitive (RFC 7235)."""
    given = next((v for k, v in headers if k == b"authorization"), None)
    if given is None:
        return None
    scheme, _, credentials = given.partition(b" ")
    return credentials.lstrip(b" ") if scheme.lower() == b"bearer" else None


class Keys:
    """The API keys a server takes, and the tenant of each."""

    def __init__(self, api_key: str | None = None, api_keys: Iterable[str] = ()) -> None:
        named = ([(api_key, DEFAULT_TENANT)] if api_key else []) + [(k, tenant_id(k)) for k in api_keys]
        if len({key for key, _ in named}) != len(named):
            raise ValueError("an API key is given twice (--api-key and --api-keys, or twice in the list): each key "
                             "is one tenant")
        for key, _ in named:
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ValueError("an API key is one word of visible ASCII characters (no spaces inside)")
        # Digests, not the keys: each comparison is of 32 bytes, whatever the
        # key's length, and the keys themselves are not kept.
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in named]

    @property
    def required(self) -> bool:
        """Whether requests need a key (False: every request is the default tenant's)."""
        return bool(self._digests)

    def tenant(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The tenant whose key a request's headers carry; None for a missing
        or wrong key. Every key is compared, in constant time: the time
        taken tells neither which key matched nor how much of one."""
        if not self._digests:
            return DEFAULT_TENANT
        given = bearer(headers)
        digest = hashlib.sha256(given if given is not None else b"\0no key").digest()
        found = None
        for expected, tenant in self._digests:
            if hmac.compare_digest(digest, expected):
                found = tenant
        return found if given is not None else None
