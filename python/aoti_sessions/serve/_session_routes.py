"""The session endpoints: list, look up, load, delete, reset, fork and save
named sessions (``/v1/sessions``), and each key's saved session files
(``/v1/session-files``); the registry (serve/_sessions.py) does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI

from ._protocol import ForkRequest, LoadRequest, SaveRequest
from ._routes import tenant_of
from ._entry import described_one

if TYPE_CHECKING:
    from ._sessions import Registry
    from ._shared import SharedRegistry

__all__ = ["install"]


def install(app: FastAPI, registry: Registry | SharedRegistry, max_session_files: int,
            max_session_files_bytes: int) -> None:
    """The session endpoints on ``app``, over ``registry``."""
    @app.get("/v1/sessions")
    async def sessions(tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return {"object": "list", "data": await registry.listing(tenant)}

    @app.post("/v1/sessions/load")
    async def load(body: LoadRequest, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.load(tenant, body.name, body.session_id))

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.lookup(tenant, session_id))

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        await registry.delete(tenant, session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/reset")
    async def reset(session_id: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.reset(tenant, session_id))

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork(session_id: str, body: ForkRequest | None = None,
                   tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return await described_one(await registry.fork(tenant, session_id, body.session_id if body else None))

    @app.post("/v1/sessions/{session_id}/save")
    async def save(session_id: str, body: SaveRequest, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        size = await registry.save(tenant, session_id, body.name)
        return {"id": session_id, "object": "session.saved", "name": body.name, "bytes": size}

    @app.get("/v1/session-files")
    async def session_files(tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        return {"object": "list", "data": await registry.files(tenant), "max_files": max_session_files,
                "max_bytes": max_session_files_bytes}

    @app.delete("/v1/session-files/{name}")
    async def delete_session_file(name: str, tenant: str = Depends(tenant_of)) -> dict[str, Any]:
        await registry.delete_file(tenant, name)
        return {"name": name, "object": "session_file.deleted", "deleted": True}
