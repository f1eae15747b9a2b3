"""The engine process of a RemoteLLM (_remote.py): an LLM, its sessions and
its generations, served over one pipe.

Calls run in worker threads (they may wait: a fork, a save, a cancellation
waiting for the step in flight), as a server's calls do in its own process.
Replies and the generations' pieces leave through one outbox drained by a
sender thread: what the step loop hands out in one step goes as one message.
A generation's ``start`` reply is queued before its first piece.

A heartbeat thread says every ``beat`` seconds that the process lives and how
long its step loop has been in one step with generations to run (StepWatch):
the parent tells a process that is stopped or wedged (no heartbeat) and a
step loop stuck in a step (a hung device, a deadlock) from a long step, which
a slow prefill chunk may be, without waiting on any one step itself.
"""

from __future__ import annotations

import itertools
import pickle
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ._generation import Event, Generation
    from ._llm import LLM, ChatSession

__all__ = ["child_main", "Started", "Finals", "Outbox", "StepWatch"]

SWITCH_INTERVAL_S = 0.0005  # the step loop waits less for the other threads (as a server's process does)
CALL_THREADS = 32


class Started(NamedTuple):
    """The reply to ``start``."""

    generation: int
    session: int
    submitted: float
    prompt_tokens: int
    cached_tokens: int


class Finals(NamedTuple):
    """A generation's counts once it ended."""

    finish_reason: str | None
    prefilled_tokens: int
    completion_tokens: int


class Outbox:
    """What one end of the pipe sends: items put from any thread, sent by a
    thread of its own; what was put while it sent goes as one message (a
    list). A full pipe (the other end not reading: stopped, wedged) holds up
    that thread only, never the threads that put."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._items: deque[tuple[Any, ...]] = deque()
        self._armed = False
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._send, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple[Any, ...]) -> None:
        """From any thread; one wake-up of the sender for all that came before it ran."""
        self._items.append(item)
        if not self._armed:
            self._armed = True
            self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Sends what was put, then ends the sender (within ``timeout``)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._armed = False  # before draining: an item put after the drain arms it again
            items = []
            while self._items:
                items.append(self._items.popleft())
            try:
                if items:
                    self._conn.send(items)
            except (OSError, ValueError):
                return  # the other end went
            if self._stopping and not self._items:
                return


class StepWatch:
    """How long an LLM's step loop has been in one step while it has
    generations to run (0 while it has none). A step is bounded (one batched
    decode and at most the prefill budget's tokens) but may be long (a prefill
    chunk on a slow CPU); a loop stuck in one (a hung device, a deadlock)
    grows without bound. Read every ``beat`` seconds: exact to one beat."""

    def __init__(self, llm: LLM) -> None:
        self._scheduler = llm._scheduler
        self._steps = -1
        self._since = time.monotonic()

    def stalled(self) -> float:
        scheduler, now = self._scheduler, time.monotonic()
        if scheduler.steps != self._steps or not (scheduler._active or scheduler._waiting):
            self._steps, self._since = scheduler.steps, now
        return now - self._since


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any class that does not round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")


def child_main(conn: Connection, package: str, device: str, threads: int | None, options: dict[str, Any],
               beat: float) -> None:
    """The engine process: loads the LLM, says so, and serves calls (with a
    heartbeat every ``beat`` seconds) until told to close or until the other
    end goes."""
    from ._llm import LLM

    # The parent decides when this process ends (it closes the pipe): a
    # Ctrl+C or SIGTERM meant for the server (its process group) must not
    # take the sessions away before the server has saved them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        llm = LLM(package, device=device, threads=threads, **options)
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send((False, portable(e)))
        return
    conn.send((True, {"device": str(llm.device)}))
    _Engine(conn, llm).serve(beat)


class _Engine:
    def __init__(self, conn: Connection, llm: LLM) -> None:
        self._conn = conn
        self._llm = llm
        self._ids = itertools.count(1)
        self._sessions: dict[int, ChatSession] = {}
        self._generations: dict[int, Generation] = {}
        self._outbox = Outbox(conn, "aoti-sessions-sender")
        self._stopping = threading.Event()

    def serve(self, beat: float) -> None:
        heart = threading.Thread(target=self._beat, args=(beat,), name="aoti-sessions-heartbeat", daemon=True)
        heart.start()
        calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="aoti-sessions-call")
        closing: int | None = None
        try:
            while closing is None:
                for cid, op, args in self._conn.recv():  # (what the parent put while it sent: a list)
                    if op == "close":
                        closing = cid
                        break
                    calls.submit(self._run, cid, op, args)
        except (EOFError, OSError):
            pass  # the parent went: nobody to answer
        self._llm.close()  # generations still running end with SessionClosedError
        calls.shutdown(wait=True)
        self._stopping.set()
        heart.join()
        if closing is not None:
            self._put(("reply", closing, True, None))
        self._outbox.stop()

    def _put(self, item: tuple[Any, ...]) -> None:
        self._outbox.put(item)

    def _beat(self, every: float) -> None:
        """The heartbeat: from a thread of its own, so that a long step does not hold it up."""
        watch = StepWatch(self._llm)
        while not self._stopping.wait(every):
            self._put(("beat", watch.stalled()))

    # -- calls -----------------------------------------------------------------
    def _run(self, cid: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            if op == "start":
                self._start(cid, *args)
                return
            value = getattr(self, "_op_" + op)(*args)
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            self._put(("reply", cid, False, portable(e)))
        else:
            self._put(("reply", cid, True, value))

    def _add(self, session: ChatSession) -> tuple[int, int]:
        sid = next(self._ids)
        self._sessions[sid] = session
        return sid, session.token_count

    def _session(self, sid: int) -> ChatSession:
        from ..errors import SessionClosedError

        session = self._sessions.get(sid)
        if session is None:
            raise SessionClosedError(f"session {sid} is closed")
        return session

    def _op_stats(self) -> dict[str, Any]:
        return self._llm.stats()

    def _op_new_session(self) -> int:
        return self._add(self._llm.new_session())[0]

    def _op_load_session(self, path: str) -> tuple[int, int]:
        return self._add(self._llm.load_session(path))

    def _op_fork(self, sid: int) -> tuple[int, int]:
        return self._add(self._session(sid).fork())

    def _op_reset(self, sid: int) -> None:
        self._session(sid).reset()

    def _op_save(self, sid: int, path: str) -> None:
        self._session(sid).save(path)

    def _op_resident(self, sid: int) -> bool:
        return self._session(sid).resident

    def _op_close_session(self, sid: int) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            session.close()

    def _op_close_generation(self, gid: int) -> tuple[Finals | None, int]:
        g = self._generations.pop(gid, None)
        if g is None:
            return None, 0
        g.close()
        return _finals(g), g._session.token_count

    def _start(self, cid: int, sid: int, ids: list[int], params: Any) -> None:
        session = self._session(sid)
        g = session.start(ids, params)
        gid = next(self._ids)
        self._generations[gid] = g
        self._put(("reply", cid, True, Started(gid, sid, g.submitted, g.prompt_tokens, g.cached_tokens)))

        def sink(event: Event) -> None:  # on the step loop's thread
            finals = None
            if event is None or isinstance(event, BaseException):
                self._generations.pop(gid, None)
                finals = _finals(g)
                if event is not None:
                    event = portable(event)
            self._put(("event", gid, event, g.completion_tokens, session.token_count, finals))

        g.on_event(sink)


def _finals(g: Generation) -> Finals:
    return Finals(g.finish_reason, g.prefilled_tokens, g.completion_tokens)


def main(argv: list[str]) -> None:
    """``python -m aoti_sessions.llm._engine_main FD``: the pipe is FD, its
    first message the LLM's arguments and the heartbeat's period."""
    conn = Connection(int(argv[0]))
    try:
        package, device, threads, options, beat = conn.recv()
    except (EOFError, OSError):
        return
    child_main(conn, package, device, threads, options, beat)

