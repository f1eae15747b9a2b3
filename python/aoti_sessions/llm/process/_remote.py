"""An LLM in a process of its own: :class:`RemoteLLM` (docs/batching.md,
"What bounds the server").

The child process (_remote_engine.py) loads the package as an :class:`LLM`
and runs its step loop; this process keeps the package's tokenizer (prompts
are made here) and proxies: :class:`RemoteSession` for a chat session,
:class:`RemoteGeneration` for a generation. A server's HTTP, chat templates,
tokenizing and streaming then share no GIL with the step loop. The child
detokenizes and checks stop strings as an LLM in this process does (the same
text), and hands over the pieces every generation got in a step in one
message; or, for a connection with ``text_here``, their token ids, whose text
is made here (the same text: the same TextStream, with the generation's stop
strings), off the step loop's thread.

Other processes may attach to the same engine process (:meth:`RemoteLLM.share`,
:meth:`RemoteLLM.attach`: the front ends of ``aoti-sessions serve
--api-workers N``): each its own connection, the sessions shared by id.

One pipe carries both ways (pickled): calls ``(call_id, op, args)`` to the
child; lists of ``("reply", call_id, ok, value)`` and ``("event", gen_id,
event, completion_tokens, token_count, finals, logprobs)`` back (logprobs:
those of the event's tokens, where the generation asked), read by one
thread here. If the child dies, every pending and later call raises
:class:`EngineProcessError` and every running generation ends with it.

Liveness: calls go out through an outbox (a child that stopped reading holds
up its sender thread, never a caller), and the child sends a heartbeat every
second or so, with how long its step loop has been in one step
(_remote_engine.StepWatch). A child silent for ``engine_timeout`` seconds
(stopped, wedged), or whose step loop has been in one step for
``step_timeout`` with generations to run (a hung device, a deadlock), is
unresponsive: pending calls and running generations end with
:class:`EngineUnresponsiveError` (a call's deadline is thus the engine's
silence, not its own length: a long save or prefill is not a wedge), later
calls raise it at once, and ``alive`` is False, until the child answers
again. What the child does meanwhile for calls given up (a session made, a
generation started) is undone once it answers.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any

import torch

from ..._session import Closable
from ...errors import EngineProcessError, EngineUnresponsiveError, Error, SessionClosedError
from ..runtime._generation import TokenEvent
from ..runtime._logprobs import TokenLogprob
from ..runtime._prompts import Prompt, Prompts
from ._remote_wire import EngineAddress, Finals, Outbox, Started
from ._remote_session import RemoteGeneration, RemoteSession

__all__ = ["RemoteLLM", "RemoteSession", "RemoteGeneration", "EngineAddress", "EngineProcessError",
           "EngineUnresponsiveError"]

log = logging.getLogger("aoti_sessions.llm")
START_TIMEOUT_S = 600.0  # loading a package (and a first CUDA context) may take a while
CLOSE_TIMEOUT_S = 60.0
# Defaults of RemoteLLM's deadlines (aoti-sessions serve --engine-timeout, --step-timeout), long
# enough for a loaded machine: the heartbeat comes from a thread of its own every second or so,
# and one step is at most a batched decode and a prefill chunk (a big model's on a slow CPU:
# a minute or more).
ENGINE_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 600.0
BEATS_PER_TIMEOUT = 4  # heartbeats (and checks here) per engine_timeout, at most one a second
# Calls whose effect stays in the child though the caller gave up: undone when their reply comes.
_MAKES_SESSION = ("new_session", "load_session", "fork")
# Calls that free what the child holds: while it does not answer, sent all the same (run once it does).
_FREES = ("close_session", "close_generation")


class _Call:
    def __init__(self, op: str) -> None:
        self.op = op
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None


class RemoteLLM(Prompts, Closable):
    """An :class:`LLM` of ``package`` run in a child process (the same
    arguments); sessions and generations are proxies with the API the server
    uses: ``new_session``, ``load_session``, ``stats``; a session's ``start``,
    ``fork``, ``reset``, ``save``, ``close``, ``token_count``, ``resident``;
    a generation's ``step``, ``on_event``, ``close`` and counts.

    ``engine_timeout``: seconds without a heartbeat after which the engine
    process is unresponsive (stopped, wedged); ``step_timeout``: seconds its
    step loop may spend in one step while generations wait (module docstring).
    ``text_here``: the engine process sends its generations' token ids and
    this process makes their text (default False: the engine makes it, one
    front end being the server's bound; several front ends attach with it on,
    taking that work off the step loop's thread). ``chat_template``,
    ``tool_parser``, ``reasoning_parser``: :class:`Prompts`' (this process
    makes the prompts and reads the replies).
    """

    _shared: str | None  # the folder of the engine's socket, once shared

    def __init__(self, package: str | os.PathLike[str], device: str | torch.device = "cpu",
                 threads: int | None = None, *, engine_timeout: float = ENGINE_TIMEOUT_S,
                 step_timeout: float = STEP_TIMEOUT_S, text_here: bool = False, chat_template: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None, **engine_options: Any) -> None:
        self._begin(package, engine_timeout, step_timeout, text_here, dict(
            chat_template=chat_template, tool_parser=tool_parser, reasoning_parser=reasoning_parser))
        # A new interpreter (no fork of a process with threads or CUDA, and
        # unlike multiprocessing's spawn, no import of the caller's script):
        # its end of a socket pair is its pipe, read for its arguments first.
        here, there = socket.socketpair()
        with there:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "aoti_sessions.llm.process._engine_main", str(there.fileno())],
                pass_fds=(there.fileno(),), stdin=subprocess.DEVNULL)
        self._conn = Connection(here.detach())
        self._conn.send((os.fspath(package), str(device), threads, engine_options, self._tick))
        self._connected()

    @classmethod
    def attach(cls, package: str | os.PathLike[str], address: EngineAddress, *,
               engine_timeout: float = ENGINE_TIMEOUT_S, step_timeout: float = STEP_TIMEOUT_S,
               text_here: bool = True, **prompt_options: Any) -> RemoteLLM:
        """This process's connection to the engine process another RemoteLLM
        of ``package`` started and shared (:meth:`share`): its sessions are
        the same, by id (:meth:`session_of`); its generations are this
        connection's. :meth:`close` detaches (the engine goes on); the engine
        ending (its first RemoteLLM closed, or it died) ends this one's calls
        with SessionClosedError or EngineProcessError. ``prompt_options``:
        :class:`Prompts`' (the other RemoteLLM's ``prompt_options``)."""
        self = cls.__new__(cls)
        self._begin(package, engine_timeout, step_timeout, text_here, prompt_options)
        self._process = None
        try:
            self._conn = Client(address.path, "AF_UNIX", authkey=address.authkey)
        except (OSError, EOFError, AuthenticationError) as e:
            raise EngineProcessError(f"cannot reach the engine process at {address.path}: "
                                     f"{type(e).__name__}: {e}") from None
        self._connected()
        return self

    def share(self) -> EngineAddress:
        """Lets other processes :meth:`attach` to this engine process; its
        address (the key in it is a secret: hand it over a pipe)."""
        if self._process is None:
            raise EngineProcessError("only the RemoteLLM that started the engine process may share it")
        address: EngineAddress = self._call("listen")
        self._shared = os.path.dirname(address.path)  # (the engine removes it; this process too, should it die)
        return address

    def session_of(self, sid: int, tokens: int) -> RemoteSession:
        """A proxy of the engine's session ``sid`` (made by this or another
        connection; ``tokens``: its token count as last known)."""
        return self._session(sid, tokens)

    def _begin(self, package: str | os.PathLike[str], engine_timeout: float, step_timeout: float,
               text_here: bool, prompt_options: dict[str, Any]) -> None:
        for name, value in (("engine_timeout", engine_timeout), ("step_timeout", step_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        Prompts.__init__(self, package, **prompt_options)
        self.package = os.fspath(package)  # (what attach() takes)
        self.text_here = bool(text_here)
        self.engine_timeout, self.step_timeout = float(engine_timeout), float(step_timeout)
        self._tick = min(1.0, self.engine_timeout / BEATS_PER_TIMEOUT)  # the heartbeat's period, and the checks

    def _connected(self) -> None:
        self._lock = threading.Lock()  # the tables below, _ended and _unresponsive
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._given_up: dict[int, str] = {}  # calls whose reply nobody waits for: their ops
        self._generations: dict[int, RemoteGeneration] = {}
        self._sessions: weakref.WeakValueDictionary[int, RemoteSession] = weakref.WeakValueDictionary()
        self._ended: BaseException | None = None
        self._unresponsive: str | None = None  # why, while the child does not answer
        self._closing = False
        self._shared = None  # the folder of the engine's socket, once shared
        ready = self._first_message()
        if isinstance(ready, BaseException):
            if self._process is not None:
                self._process.wait(CLOSE_TIMEOUT_S)
            raise ready
        self._device = torch.device(ready["device"])
        self._pid: int = ready["pid"]
        self._heard = time.monotonic()  # the child's last message
        self._stalled = 0.0  # its step loop's time in one step, as of that message
        self._over = threading.Event()  # set once it ended (closed or died)
        self._outbox = Outbox(self._conn, "aoti-sessions-engine-sender")
        self._reader = threading.Thread(target=self._read, name="aoti-sessions-engine-reader", daemon=True)
        self._reader.start()
        self._watchdog = threading.Thread(target=self._watch, name="aoti-sessions-engine-watchdog", daemon=True)
        self._watchdog.start()
        if self.text_here:
            self._call("hand_tokens")

    def _first_message(self) -> Any:
        try:
            if self._conn.poll(START_TIMEOUT_S):
                ok, value = self._conn.recv()
                return value if ok or isinstance(value, BaseException) else EngineProcessError(str(value))
        except (EOFError, OSError):
            pass
        if self._process is None:
            self._conn.close()
            return EngineProcessError("the engine process did not answer (it ended)")
        self._process.kill()
        return EngineProcessError(f"the engine process did not start (exit code {self._process.wait()})")

    # -- the LLM's API -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def alive(self) -> bool:
        """Whether the engine process serves calls (not closed, not ended,
        not unresponsive)."""
        return self._ended is None and self._unresponsive is None

    @property
    def unavailable(self) -> str | None:
        """Why the engine process serves no calls now (None while it does)."""
        ended = self._ended
        return str(ended) if ended is not None else self._unresponsive

    def wait_ended(self, timeout: float | None = None) -> BaseException | None:
        """Waits until the engine process ends (closed, or died); the error
        its calls now raise (EngineProcessError where it died), or None
        after ``timeout`` seconds."""
        self._over.wait(timeout)
        return self._ended

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._pid

    def stats(self) -> dict[str, Any]:
        """The engine's and its step loop's counters (:meth:`LLM.stats`)."""
        return dict(self._call("stats"))

    def new_session(self, prompt: Prompt | None = None, *, cache: str | None = None) -> RemoteSession:
        """A session of the engine process (:meth:`LLM.new_session`: with
        ``cache``, from its prefix cache; ``prompt`` made into ids here)."""
        if cache is not None and not isinstance(cache, str):
            raise TypeError(f"cache must be a str (a namespace), got {type(cache).__name__}")
        ids = self.prompt_ids(prompt) if prompt is not None else None
        return self._session(*self._call("new_session", ids, cache))

    def load_session(self, path: str | os.PathLike[str]) -> RemoteSession:
        return self._session(*self._call("load_session", os.fspath(path)))

    def close(self) -> None:
        """Closes the LLM in the child (generations still running end with
        SessionClosedError) and waits for the child to exit; idempotent."""
        with self._lock:
            if self._ended is not None:
                return
            self._closing = True
        try:
            self._call("close")  # (an attached one: detaches)
        except EngineUnresponsiveError:
            if self._process is not None:
                self._process.kill()  # (stopped or wedged: it would not exit by itself)
        except (EngineProcessError, SessionClosedError):
            pass
        if self._process is not None:
            try:
                self._process.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._end(SessionClosedError("the LLM is closed"))
        self._outbox.stop(CLOSE_TIMEOUT_S)
        self._conn.close()

    def __repr__(self) -> str:
        return f"RemoteLLM({self.name!r}, {self._device}, engine process {self._pid})"

    # -- the pipe ----------------------------------------------------------------
    def _session(self, sid: int, tokens: int) -> RemoteSession:
        session = RemoteSession(self, sid, tokens)
        self._sessions[sid] = session
        return session

    def _forget_generation(self, gid: int) -> None:
        """Generation ``gid``'s events from here on are dropped (it closed)."""
        with self._lock:
            self._generations.pop(gid, None)

    def _call(self, op: str, *args: Any) -> Any:
        call = _Call(op)
        with self._lock:
            if self._ended is not None:
                raise type(self._ended)(*self._ended.args)  # a fresh one: no traceback piling up
            if self._unresponsive is not None:
                if op in _FREES:
                    self._post(op, *args)  # run once it answers again
                raise EngineUnresponsiveError(self._unresponsive)
            cid = next(self._ids)
            self._calls[cid] = call
        self._outbox.put((cid, op, args))
        call.done.wait()  # (the watchdog ends the wait of a call to a child that went silent)
        if call.ok:
            return call.value
        raise call.value

    def _post(self, op: str, *args: Any) -> None:
        """A call nobody waits for (with the lock held)."""
        cid = next(self._ids)
        self._given_up[cid] = op
        self._outbox.put((cid, op, args))

    def _read(self) -> None:
        try:
            while True:
                items = self._conn.recv()
                self._heard = time.monotonic()
                for item in items:
                    if item[0] == "reply":
                        self._reply(*item[1:])
                    elif item[0] == "event":
                        self._event(*item[1:])
                    else:  # a heartbeat
                        self._stalled = item[1]
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a message this end cannot read: the pipe is lost
            if self._process is not None:
                self._process.kill()
            self._end(EngineProcessError(f"unreadable message from the engine process: {type(e).__name__}: {e}"))
            return
        self._end(self._death())

    def _reply(self, cid: int, ok: bool, value: Any) -> None:
        with self._lock:
            call = self._calls.pop(cid, None)
            if call is None:  # given up: undo what it made
                op = self._given_up.pop(cid, None)
                if ok and op == "start":
                    self._post("close_generation", value.generation)
                elif ok and op in _MAKES_SESSION:
                    self._post("close_session", value[0])
                return
        if ok and isinstance(value, Started):  # before its events, which follow in order
            session = self._sessions[value.session]
            value = RemoteGeneration(session, value)
            with self._lock:
                self._generations[value.id] = value
        call.ok, call.value = ok, value
        call.done.set()

    # -- liveness ----------------------------------------------------------------
    def _watch(self) -> None:
        """The watchdog: every tick, whether the child answers (its heartbeat) and its step loop moves."""
        while not self._over.wait(self._tick):
            silent = time.monotonic() - self._heard
            why = None
            if silent > self.engine_timeout:
                why = (f"no heartbeat for more than {self.engine_timeout:g} s (engine timeout): the process is "
                       "stopped or wedged")
            elif self._stalled > self.step_timeout:
                why = (f"its step loop has been in one step for more than {self.step_timeout:g} s with "
                       "generations waiting (step timeout): a hung device or a deadlock")
            if why is not None and self._unresponsive is None:
                self._give_up(f"the engine process (pid {self._pid}) is unresponsive: {why}")
            elif why is None and self._unresponsive is not None:
                with self._lock:
                    self._unresponsive = None
                log.warning("the engine process (pid %s) answers again", self._pid)

    def _give_up(self, why: str) -> None:
        """The child does not answer: pending calls and running generations
        end with EngineUnresponsiveError; later calls raise it at once."""
        with self._lock:
            if self._ended is not None:
                return
            self._unresponsive = why
            calls, self._calls = self._calls, {}
            self._given_up.update((cid, call.op) for cid, call in calls.items())
            generations, self._generations = self._generations, {}
            for gid in generations:
                self._post("close_generation", gid)  # (its session is free again once the child answers)
        log.error("%s; %d calls and %d generations fail", why, len(calls), len(generations))
        for call in calls.values():
            call.ok, call.value = False, EngineUnresponsiveError(why)
            call.done.set()
        for g in generations.values():
            g._event(EngineUnresponsiveError(why), g.completion_tokens, g._session.token_count,
                     Finals(None, g.prefilled_tokens, g.completion_tokens))

    def _event(self, gid: int, event: TokenEvent, completion_tokens: int, token_count: int,
               finals: Finals | None, logprobs: list[TokenLogprob] | None) -> None:
        with self._lock:
            g = self._generations.get(gid) if finals is None else self._generations.pop(gid, None)
        if g is not None:
            g._event(event, completion_tokens, token_count, finals, logprobs)

    def _death(self) -> Error:
        if self._closing:
            return SessionClosedError("the LLM is closed")
        if self._process is None:  # (attached: not this process's child)
            return EngineProcessError(f"the engine process (pid {self._pid}) ended, or closed its connection")
        try:
            code: int | None = self._process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return EngineProcessError(f"the engine process ended (exit code {code})")

    def _end(self, error: BaseException) -> None:
        """Fails every pending call and running generation with ``error``; later calls raise it."""
        with self._lock:
            if self._ended is None:
                self._ended = error
            calls, self._calls = self._calls, {}
            generations, self._generations = self._generations, {}
            self._given_up.clear()
        for call in calls.values():
            call.ok, call.value = False, error
            call.done.set()
        for g in generations.values():
            g._event(error, g.completion_tokens, g._session.token_count, Finals(None, g.prefilled_tokens,
                                                                                g.completion_tokens))
        if self._shared is not None:  # (set by share(): only the process that started the engine)
            shutil.rmtree(self._shared, ignore_errors=True)
        self._over.set()
