"""Session files: the files clients save sessions to and load them from
(``/v1/sessions/ID/save``, ``/v1/session-files``), a tenant's own folder in
``--session-dir`` each, and the writes behind them.

A file's name is a plain visible name inside the tenant's folder, nothing a
client could point elsewhere with. A tenant's saved files are bounded in count
and bytes (403 past them); a write that finds the disk full is a 507, and such
failures are logged once an episode (the first failure, then one line when
writing works again), and counted. An error names the file as the client did:
no server path or temporary name in the answer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SessionFileError, SessionFileNotFoundError
from ._errors import APIError
from ._protocol import FILE_NAME_PATTERN
from ._tenants import DEFAULT_TENANT, TENANTS_DIR
from ._threads import in_thread

if TYPE_CHECKING:
    from ._model import ServedSession

log = logging.getLogger("aoti_sessions.serve")
# A session file's name: a plain, visible file name inside --session-dir (short
# enough for the writer's temporary name beside it).
_FILE_NAME = re.compile(FILE_NAME_PATTERN)
# The writer's temporary file beside a session file (csrc/core/atomic_file.cc):
# its name carries the server's pid, kept out of answers.
_TEMPORARY = re.compile(r"\S*\.aoti-tmp-\d+-\d+")
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class SessionFiles:
    """The tenants' session files in ``session_dir`` (None: saving and loading is off)."""

    def __init__(self, session_dir: Path | None, max_files: int, max_file_bytes: int) -> None:
        self.session_dir = session_dir
        self.max_files, self.max_file_bytes = max_files, max_file_bytes  # a tenant's saved session files
        self._saving: dict[str, asyncio.Lock] = {}  # a tenant's saves, one at a time (each checks the limits)
        self._out_of_space = Failures("saving session files")

    def home(self, tenant: str) -> Path:
        """The folder of ``tenant``'s session files (its parked ones in ``.live`` inside)."""
        assert self.session_dir is not None
        return self.session_dir if tenant == DEFAULT_TENANT else self.session_dir / TENANTS_DIR / tenant

    def _on(self) -> None:
        if self.session_dir is None:
            raise APIError(400, "saving and loading sessions is off: start the server with --session-dir DIR",
                           "session_dir_not_set", "name")

    def path(self, tenant: str, name: str) -> Path:
        """``name`` as a file of ``tenant``'s in the session directory: a
        plain visible file name, nothing a client could point elsewhere with
        (400)."""
        self._on()
        if (not _FILE_NAME.fullmatch(name) or name in (".", "..") or ".." in name
                or os.path.basename(name) != name):
            raise APIError(400, f"invalid session file name {name!r}: a plain file name of letters, digits, "
                                "'.', '_' and '-', not starting with '.' or '-', without '..'",
                           "invalid_name", "name")
        return self.home(tenant) / name

    def _stats(self, tenant: str) -> list[tuple[str, os.stat_result]]:
        """``tenant``'s session files: (name, stat) of each plain file a
        client could have named."""
        try:
            found = list(os.scandir(self.home(tenant)))
        except FileNotFoundError:
            return []
        out = []
        for item in found:
            if _FILE_NAME.fullmatch(item.name) and ".." not in item.name:
                try:
                    if item.is_file(follow_symlinks=False):
                        out.append((item.name, item.stat(follow_symlinks=False)))
                except OSError:
                    pass  # (gone meanwhile)
        return sorted(out)

    async def listing(self, tenant: str) -> list[dict[str, Any]]:
        """``tenant``'s session files, as ``GET /v1/session-files`` lists them."""
        self._on()
        return [{"name": name, "object": "session_file", "bytes": st.st_size, "modified": int(st.st_mtime)}
                for name, st in await in_thread(lambda: self._stats(tenant))]

    async def delete(self, tenant: str, name: str) -> None:
        path = self.path(tenant, name)

        def delete() -> bool:
            try:
                if not stat.S_ISREG(path.lstat().st_mode):
                    return False  # (not a file a client saved)
                path.unlink()
            except FileNotFoundError:
                return False
            return True

        if not await in_thread(delete):
            raise APIError(404, f"no session file {name!r}", "file_not_found", "name")

    def _check_room(self, tenant: str, name: str) -> None:
        """403 when ``tenant``'s session files are at the server's limits
        (their count, or their bytes: a save that starts under it may end
        past it by its own size); a file of the same name counts as replaced."""
        others = [st.st_size for file, st in self._stats(tenant) if file != name]
        if len(others) >= self.max_files:
            raise APIError(403, f"cannot save the session as {name!r}: your saved sessions are {len(others)} files, "
                                f"the server's limit; delete one (DELETE /v1/session-files/NAME) or save over one",
                           "session_files_limit", "name")
        if sum(others) >= self.max_file_bytes:
            raise APIError(403, f"cannot save the session as {name!r}: your saved sessions hold {sum(others)} bytes, "
                                f"the server's limit is {self.max_file_bytes}; delete some "
                                "(DELETE /v1/session-files/NAME)", "session_files_limit", "name")

    def saving(self, tenant: str) -> asyncio.Lock:
        """Held around one save of ``tenant``'s (its limits checked and the file written, one at a time)."""
        return self._saving.setdefault(tenant, asyncio.Lock())

    async def write(self, tenant: str, name: str, session: ServedSession) -> int:
        """Writes held ``session`` as ``tenant``'s file ``name`` (its limits
        checked first; the caller holds :meth:`saving`); its bytes."""
        path = self.path(tenant, name)
        with self.errors("save the session as", name, path):
            await in_thread(lambda: self._check_room(tenant, name))
            await in_thread(lambda: save_session(session, path))
        self._out_of_space.succeeded()
        return path.stat().st_size

    @contextmanager
    def errors(self, doing: str, name: str, path: Path) -> Iterator[None]:
        """A session file's failure as a 400 that names the file as the
        client did: no server path or temporary name in the answer; the
        server out of space, 507."""
        try:
            yield
        except (SessionFileError, OSError) as e:
            if out_of_space(e):
                self._out_of_space.failed(f"cannot {doing} {name!r}: {error_text(e)}")
                raise APIError(507, f"cannot {doing} {name!r}: the server is out of space for session files; try "
                                    "again later", "out_of_space", "name") from e
            if not isinstance(e, SessionFileError):
                raise
            assert self.session_dir is not None
            message = _TEMPORARY.sub("a temporary file", str(e).replace(str(path), repr(name)))
            message = message.replace(str(path.parent), "--session-dir").replace(str(self.session_dir),
                                                                                 "--session-dir")
            if isinstance(e, SessionFileNotFoundError):
                raise APIError(404, f"no session file {name!r}", "file_not_found", "name") from e
            raise APIError(400, f"cannot {doing} {name!r}: {message}", "invalid_session_file", "name") from e


def signature(path: Path) -> tuple[int, int, int] | None:
    """What tells one write of a file from another (each write is a new file
    renamed into place): inode, size, modification time; None if absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def save_session(session: ServedSession, path: Path) -> None:
    """Writes ``session`` to ``path``, making its folder first (a tenant's,
    at its first file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    session.save(path)


def out_of_space(error: BaseException) -> bool:
    """Whether ``error`` is a write that found its disk (or the writer's
    quota) full: an OSError, or the runtime's SessionFileError, which says
    so in the C library's words."""
    if isinstance(error, OSError) and error.errno in _OUT_OF_SPACE:
        return True
    return isinstance(error, SessionFileError) and any(os.strerror(n) in str(error) for n in _OUT_OF_SPACE)


def error_text(error: BaseException) -> str:
    return str(error) or type(error).__name__


class Failures:
    """The log of one kind of write that may fail over and over (a full
    disk fails every park and checkpoint until space is made): the first
    failure of an episode is logged, the rest only counted, and one line
    says when writing works again."""

    def __init__(self, what: str) -> None:
        self.what, self.count = what, 0

    def failed(self, message: str) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("%s (further failures of %s are not logged until one succeeds)", message, self.what)

    def succeeded(self) -> None:
        if self.count:
            log.info("%s works again, after %d failures", self.what, self.count)
            self.count = 0
