"""Stored responses (``POST /v1/responses`` with ``store`` on, the default):
what a follow-up naming one (``previous_response_id``) continues from, and
what ``GET /v1/responses/{id}`` answers.

A stored response keeps its body, the conversation through its output (chat
messages, the instructions left out: a follow-up brings its own) and the
named session of its chain (serve/_sessions.py), whose cache holds that
conversation's tokens while the response is the chain's latest. The first
follow-up on it *claims* it (:meth:`ResponseStore.claim`) and goes on in
that session; any later follow-up on it forks the session (the common start
of the conversations is reused; serve/_responses.py). The session is only a
cache: a response whose session went (deleted, closed at its TTL with no
session dir, or parked to make room for another session: serve/_sessions.py)
is followed up in a new session, prefilling the whole conversation (a
parked one comes back from its file).

Like named sessions, stored responses belong to the tenant (API key) that
made them (another's id is unknown to it) and are parked: one unused for
the registry's TTL leaves memory; with persistence on (a session dir) each
is also written at once to ``SESSION_DIR[/.tenants/T]/.responses/ID.json``
(rewritten when claimed), read back when asked for again, and so survives a
restart. With several front ends, the store lives in the hub's registry and
the front ends ask it (:class:`RemoteResponses`, serve/_shared.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._threads import in_thread
from ._tenants import scoped

log = logging.getLogger("aoti_sessions.serve")
RESPONSES_DIR = ".responses"  # in a tenant's folder of --session-dir (a name no client's file can take)
RECORD_FORMAT = "aoti_sessions.serve.response"
_ID = re.compile(r"resp_[A-Za-z0-9]{1,64}")


@dataclass
class Stored:
    """A stored response."""

    id: str
    body: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # chat messages through its output (no instructions)
    session: str | None  # the named session of its chain
    next: str | None = None  # the follow-up that claimed its session (it is then past this response)
    last_used: float = field(default_factory=time.time)


class ResponseStore:
    """Stored responses by tenant and id (module docstring); ``folder``:
    where a tenant's are written (None: memory only)."""

    OPS = ("get", "put", "claim", "delete")  # what a front end may ask of the hub's store

    def __init__(self, folder: Callable[[str], Path] | None) -> None:
        self._folder = folder
        self._records: dict[str, Stored] = {}

    def __len__(self) -> int:
        return len(self._records)

    def _path(self, tenant: str, response_id: str) -> Path | None:
        if self._folder is None or not _ID.fullmatch(response_id):
            return None
        return self._folder(tenant) / RESPONSES_DIR / f"{response_id}.json"

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The response, from memory or its file; None if unknown."""
        key = scoped(tenant, response_id)
        record = self._records.get(key)
        if record is None and (path := self._path(tenant, response_id)) is not None:
            record = await in_thread(lambda: _read(path, response_id))
            if record is not None:
                record = self._records.setdefault(key, record)  # (another request may have read it meanwhile)
        if record is not None:
            record.last_used = time.time()
        return record

    async def put(self, tenant: str, record: Stored) -> None:
        self._records[scoped(tenant, record.id)] = record
        await self._write(tenant, record)

    async def claim(self, tenant: str, response_id: str, by: str) -> bool:
        """Whether the session of the response is still at it (no follow-up
        claimed it before); it is ``by``'s from now on either way."""
        record = await self.get(tenant, response_id)
        if record is None or record.next is not None:
            return False
        record.next = by
        await self._write(tenant, record)
        return True

    async def delete(self, tenant: str, response_id: str) -> Stored | None:
        """Forgets the response; what it was (None: it was unknown)."""
        record = await self.get(tenant, response_id)
        self._records.pop(scoped(tenant, response_id), None)
        if (path := self._path(tenant, response_id)) is not None:
            await in_thread(lambda: path.unlink(missing_ok=True))
        return record

    def holds(self, tenant: str, session_id: str) -> bool:
        """Whether ``session_id`` is the session of a stored response in memory."""
        return any(r.session == session_id and k == scoped(tenant, r.id) for k, r in self._records.items())

    def expire(self, cutoff: float) -> int:
        """Out of memory: the responses unused since ``cutoff`` (their files stay)."""
        old = [k for k, r in self._records.items() if r.last_used < cutoff]
        for key in old:
            del self._records[key]
        return len(old)

    async def _write(self, tenant: str, record: Stored) -> None:
        path = self._path(tenant, record.id)
        if path is not None:
            doc = {"format": RECORD_FORMAT, "version": 1, **asdict(record)}
            await in_thread(lambda: _write(path, doc))


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(temporary, path)


def _read(path: Path, response_id: str) -> Stored | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("stored response %r cannot be read (%s): it is left out", response_id, e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or doc.get("id") != response_id:
        log.warning("stored response %r: its file is not a stored response: it is left out", response_id)
        return None
    return Stored(doc["id"], doc["body"], doc["conversation"], doc.get("session"), doc.get("next"))


class RemoteResponses:
    """The hub's store, asked over a front end's link (serve/_shared.py)."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self._call = call

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        record: Stored | None = await self._call("responses", "get", tenant, response_id)
        return record

    async def put(self, tenant: str, record: Stored) -> None:
        await self._call("responses", "put", tenant, record)

    async def claim(self, tenant: str, response_id: str, by: str) -> bool:
        return bool(await self._call("responses", "claim", tenant, response_id, by))

    async def delete(self, tenant: str, response_id: str) -> Stored | None:
        record: Stored | None = await self._call("responses", "delete", tenant, response_id)
        return record
