"""The engine process of a RemoteLLM (_remote.py): an LLM, its sessions and
its generations, served over the pipe of the RemoteLLM that started it and,
once that one asked (``listen``), over connections of other processes too
(RemoteLLM.attach: a server's front ends, serve/_fleet.py).

Every connection is a peer: its calls, its generations, whose events go back
on it. Sessions are the engine's, by id, whichever peer names them (the
registry of the process that shares them says who may). A peer that detaches
or goes stops its generations; the engine ends with its first peer. Other
processes connect through a Unix socket in a folder only this user can enter
(0700), with a key the first peer hands out (multiprocessing's HMAC
handshake): what the connection carries is pickles.

Calls run in worker threads (they may wait: a fork, a save, a cancellation
waiting for the step in flight), as a server's calls do in its own process.
Replies and the generations' pieces leave through one outbox drained by a
sender thread: what the step loop hands out in one step goes as one message,
sent once the loop waits for the device (Scheduler.before_wait), so that the
sender's pickling and writing do not take the GIL between the launches of the
step the loop queues (every launch lets the GIL go).
A generation's ``start`` reply is queued before its first piece.

A heartbeat thread says every ``beat`` seconds that the process lives and how
long its step loop has been in one step with generations to run (StepWatch):
the parent tells a process that is stopped or wedged (no heartbeat) and a
step loop stuck in a step (a hung device, a deadlock) from a long step, which
a slow prefill chunk may be, without waiting on any one step itself.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, Any

from ._remote_wire import EngineAddress, Finals, Outbox, Started

if TYPE_CHECKING:
    from ..runtime._generation import Generation, TokenEvent
    from ..runtime._llm import LLM, ChatSession

__all__ = ["child_main", "StepWatch"]

SWITCH_INTERVAL_S = 0.0005  # the step loop waits less for the other threads (as a server's process does)
CALL_THREADS = 32


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
    from ..runtime._llm import LLM

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
    conn.send((True, {"device": str(llm.device), "pid": os.getpid()}))
    _Engine(conn, llm).serve(beat)


class _Peer:
    """One connection to the engine process: its outbox, and the generations
    it started (their events go back on it)."""

    def __init__(self, conn: Connection, name: str, *, first: bool) -> None:
        self.conn = conn
        self.first = first  # the RemoteLLM that started the process: its close ends it
        self.outbox = Outbox(conn, name)
        self.generations: dict[int, Generation] = {}
        self.tokens = False  # its generations' events go as token ids (its process makes their text), else as text
        self.gone = False  # it detached or went (set under the engine's lock)

    def put(self, item: tuple[Any, ...], *, later: bool = False) -> None:
        self.outbox.put(item, later=later)


class _Engine:
    def __init__(self, conn: Connection, llm: LLM) -> None:
        self._llm = llm
        self._ids = itertools.count(1)
        self._sessions: dict[int, ChatSession] = {}
        self._first = _Peer(conn, "aoti-sessions-sender", first=True)
        self._lock = threading.Lock()  # _peers, _listener
        self._peers = {self._first}
        self._listener: Listener | None = None
        self._address: EngineAddress | None = None
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="aoti-sessions-call")
        self._stopping = threading.Event()
        # The events a step hands out are sent while the step loop waits for
        # the device (or for work), not while it queues a step: the senders'
        # pickling and writing take the GIL then, not between its launches.
        llm._scheduler.before_wait.append(self._flush)

    def _flush(self) -> None:
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.outbox.flush()

    def serve(self, beat: float) -> None:
        heart = threading.Thread(target=self._beat, args=(beat,), name="aoti-sessions-heartbeat", daemon=True)
        heart.start()
        closing = self._read(self._first)
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            assert self._address is not None
            listener.close()
            shutil.rmtree(os.path.dirname(self._address.path), ignore_errors=True)
        self._llm.close()  # generations still running end with SessionClosedError (on every peer)
        self._calls.shutdown(wait=True)
        self._stopping.set()
        heart.join()
        if closing is not None:
            self._first.put(("reply", closing, True, None))
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.outbox.stop(1.0 if peer is not self._first else None)

    def _read(self, peer: _Peer) -> int | None:
        """Runs ``peer``'s calls until it says close (that call's id) or goes (None)."""
        try:
            while True:
                for cid, op, args in peer.conn.recv():  # (what the peer put while it sent: a list)
                    if op == "close":
                        return int(cid)
                    self._calls.submit(self._run, peer, cid, op, args)
        except (EOFError, OSError):
            return None  # it went: nobody to answer
        except RuntimeError:
            return None  # (calls after the engine began closing)

    def _beat(self, every: float) -> None:
        """The heartbeat, to every peer: from a thread of its own, so that a long step does not hold it up."""
        watch = StepWatch(self._llm)
        while not self._stopping.wait(every):
            stalled = watch.stalled()
            with self._lock:
                peers = list(self._peers)
            for peer in peers:
                peer.put(("beat", stalled))

    # -- other processes ---------------------------------------------------------
    def _accept(self, listener: Listener, authkey: bytes) -> None:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                if self._listener is not listener:
                    return  # closed: the engine ends
                continue
            # The key's handshake in a thread of its own: a process that connects and stalls holds up no other.
            threading.Thread(target=self._admit, args=(listener, conn, authkey), name="aoti-sessions-admit",
                             daemon=True).start()

    def _admit(self, listener: Listener, conn: Connection, authkey: bytes) -> None:
        try:
            deliver_challenge(conn, authkey)  # (a process without the key is refused here)
            answer_challenge(conn, authkey)
            conn.send((True, {"device": str(self._llm.device), "pid": os.getpid()}))  # (before any beat)
        except Exception:  # noqa: BLE001 - AuthenticationError, a connection gone: refused
            conn.close()
            return
        peer = _Peer(conn, "aoti-sessions-peer-sender", first=False)
        with self._lock:
            if self._listener is not listener:
                conn.close()
                return
            self._peers.add(peer)
        self._serve_peer(peer)

    def _serve_peer(self, peer: _Peer) -> None:
        """An attached peer's calls until it detaches or goes: then its
        generations stop (its sessions stay: they are the engine's), and one
        a call of it starts after that is stopped at once (_start)."""
        closing = self._read(peer)
        with self._lock:
            self._peers.discard(peer)
            peer.gone = True
            generations = list(peer.generations.values())
            peer.generations.clear()
        for g in generations:
            g.close()
        if closing is not None:
            peer.put(("reply", closing, True, None))
        peer.outbox.stop(1.0)
        peer.conn.close()

    # -- calls -----------------------------------------------------------------
    def _run(self, peer: _Peer, cid: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            if op == "start":
                self._start(peer, cid, *args)
                return
            value = getattr(self, "_op_" + op)(peer, *args)
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            peer.put(("reply", cid, False, portable(e)))
        else:
            peer.put(("reply", cid, True, value))

    def _add(self, session: ChatSession) -> tuple[int, int]:
        sid = next(self._ids)
        self._sessions[sid] = session
        return sid, session.token_count

    def _session(self, sid: int) -> ChatSession:
        from ...errors import SessionClosedError

        session = self._sessions.get(sid)
        if session is None:
            raise SessionClosedError(f"session {sid} is closed")
        return session

    def _op_listen(self, peer: _Peer) -> EngineAddress:
        """Other processes may connect from now on (RemoteLLM.share)."""
        if not peer.first:
            raise PermissionError("only the process that started the engine process may share it")
        with self._lock:
            if self._address is None:
                folder = tempfile.mkdtemp(prefix="aoti-sessions-engine-")  # (0700: this user's alone)
                authkey = os.urandom(32)
                self._listener = Listener(os.path.join(folder, "engine.sock"), "AF_UNIX")  # (the key: _admit)
                self._address = EngineAddress(os.path.join(folder, "engine.sock"), authkey)
                threading.Thread(target=self._accept, args=(self._listener, authkey), name="aoti-sessions-listener",
                                 daemon=True).start()
            return self._address

    def _op_hand_tokens(self, peer: _Peer) -> None:
        """``peer``'s generations from now on send token ids: its process makes their text."""
        peer.tokens = True

    def _op_stats(self, _: _Peer) -> dict[str, Any]:
        return self._llm.stats()

    def _op_new_session(self, _: _Peer, ids: list[int] | None = None, cache: str | None = None) -> tuple[int, int]:
        """A session (from the prefix cache's ``cache`` namespace, by ``ids``): its id and token count."""
        return self._add(self._llm.new_session(ids, cache=cache))

    def _op_load_session(self, _: _Peer, path: str) -> tuple[int, int]:
        return self._add(self._llm.load_session(path))

    def _op_fork(self, _: _Peer, sid: int) -> tuple[int, int]:
        return self._add(self._session(sid).fork())

    def _op_reset(self, _: _Peer, sid: int) -> None:
        self._session(sid).reset()

    def _op_save(self, _: _Peer, sid: int, path: str) -> None:
        self._session(sid).save(path)

    def _op_resident(self, _: _Peer, sid: int) -> bool:
        return self._session(sid).resident

    def _op_settle(self, _: _Peer, sid: int, timeout: float) -> int:
        """Waits (up to ``timeout`` seconds) until no generation runs on
        session ``sid`` (one of a peer that went is being stopped); its
        token count."""
        session = self._session(sid)
        deadline = time.monotonic() + timeout
        while session.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        return session.token_count

    def _op_close_session(self, _: _Peer, sid: int) -> None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            session.close()

    def _op_close_generation(self, peer: _Peer, gid: int) -> tuple[Finals | None, int]:
        g = peer.generations.pop(gid, None)
        if g is None:
            return None, 0
        g.close()
        return _finals(g), g._session.token_count

    def _start(self, peer: _Peer, cid: int, sid: int, ids: list[int], params: Any) -> None:
        session = self._session(sid)
        scheduler = self._llm._scheduler
        g = session.start(ids, params)
        gid = next(self._ids)
        with self._lock:
            gone = peer.gone
            if not gone:
                peer.generations[gid] = g
        if gone:  # (its peer went while this call waited its turn: nobody reads it)
            g.close()
            return
        peer.put(("reply", cid, True, Started(gid, sid, g.submitted, g.prompt_tokens, g.cached_tokens,
                                              tuple(g.params.stop), tuple(g.params.keep_special_tokens),
                                              g.logprobs is not None)))
        sent = 0  # logprobs sent (of g.logprobs: each event carries those of the tokens since the one before)

        def sink(event: TokenEvent) -> None:  # on the step loop's thread
            nonlocal sent
            finals = None
            if event is None or isinstance(event, BaseException):
                peer.generations.pop(gid, None)
                finals = _finals(g)
                if event is not None:
                    event = portable(event)
            logprobs, sent = (g.logprobs[sent:], len(g.logprobs)) if g.logprobs is not None else (None, 0)
            # (on the step loop's thread: sent once it waits, _flush; else now)
            peer.put(("event", gid, event, g.completion_tokens, session.token_count, finals, logprobs),
                     later=scheduler.on_loop())

        if peer.tokens:
            g.on_tokens(sink)
        else:
            g.on_event(sink)  # (the text made here, on the step loop's thread)


def _finals(g: Generation) -> Finals:
    return Finals(g.finish_reason, g.prefilled_tokens, g.completion_tokens)


def main(argv: list[str]) -> None:
    """``python -m aoti_sessions.llm.process._engine_main FD``: the pipe is FD, its
    first message the LLM's arguments and the heartbeat's period."""
    conn = Connection(int(argv[0]))
    try:
        package, device, threads, options, beat = conn.recv()
    except (EOFError, OSError):
        return
    child_main(conn, package, device, threads, options, beat)

