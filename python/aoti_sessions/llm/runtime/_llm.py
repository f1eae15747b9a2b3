"""An exported LLM on an Engine: chat sessions that remember their tokens, and
generation a step at a time.

A session's KV cache is position-addressed, so the session keeps the list of
tokens whose keys and values are in it. A new request keeps the longest
common prefix of that list and its prompt and feeds only the rest: a follow-up
turn prefills what is new, and a history that diverges rewinds to where it
diverged (a position change, nothing copied). Recurrent state (hybrid models)
took in every position and cannot rewind by position: a session keeps it as
it was at the start of its last turns and at the end of their prompts
(checkpoints) and rewinds to the latest one at most where the history
diverged, feeding the rest again. A chat prompt keeps the session's own ids
for the history it fed as text, its replies as generated (_prompts.py).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..._engine import Engine
from ..._session import Closable, Session
from ...errors import CapacityError, PackageError, SessionBusyError, SessionClosedError, SessionFileError
from ._generation import Completion, Generation
from ._grammar import Grammars
from ._params import SamplingParams, sampling_params
from ._prefix import DEFAULT_BYTES_WITHOUT_BUDGET, DEFAULT_ENTRIES, PrefixCache
from ._saved import chat_attachment, saved_tokens
from ._scheduler import Scheduler
from ._prompts import ChatPrompt, ContextLengthError, Prompt, Prompts, Spelling

__all__ = ["LLM", "ChatSession", "Prompt", "ContextLengthError"]

log = logging.getLogger("aoti_sessions.llm")


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LLM(Prompts, Closable):
    """A package written by :func:`aoti_sessions.llm.export`, loaded once.

    ``threads``: the threads of the model's CPU kernels, set with
    ``torch.set_num_threads`` (for the whole process). Left unset on a CPU
    device where torch uses every CPU, a warning is logged: a kernel waits for
    its slowest thread, so other work on the machine stalls every step.

    ``rewind_checkpoints``: for a model with recurrent state (hybrid), how
    many turns back a chat session can rewind cheaply: it keeps the state at
    the start of its last that many turns and at the end of their prompts
    (device memory: one slot of recurrent state each, two a turn at most,
    counted as the session's). A request whose history diverges within them
    (a regenerated or edited last turn at its start, a reply that comes back
    edited or without its thinking at its prompt's end) rewinds to the latest
    one before the divergence and feeds the rest; further back, or with 0,
    the whole history is fed again. An offloaded session loses its
    checkpoints.

    ``chat_template``, ``tool_parser``, ``reasoning_parser``: how chat
    prompts are made and replies read (:class:`Prompts`).
    ``prefix_cache``: sessions made with a namespace (:meth:`new_session`)
    are kept once closed, at most this many (0: none), to start later
    sessions of that namespace whose prompts begin the same way
    (llm/runtime/_prefix.py; the engine closes them first when it needs room);
    ``prefix_cache_bytes``: their state's bytes at most (default: a quarter
    of ``memory_budget``, or 1 GiB without one). :attr:`prefix_cache`.

    ``decode_one=False``: a lone chat steps on the batched ``decode`` at one
    row, not on the package's ``decode_one`` (export's) where it has one.

    ``engine_options`` go to :class:`aoti_sessions.Engine` (``max_sessions``,
    ``memory_budget``, ``host_budget``, ``idle_timeout``, ``lanes``,
    ``trust_op_modules``, ...).
    Every chat session's generation runs on one step loop (a thread of the
    LLM's, _scheduler.py): each step decodes one token for every session that
    is generating, in one batched call, plus chunks of new prompts.
    """

    def __init__(self, package: str | os.PathLike[str], device: str | torch.device = "cpu",
                 threads: int | None = None, rewind_checkpoints: int = 1, prefix_cache: int = DEFAULT_ENTRIES,
                 prefix_cache_bytes: int | None = None, *, chat_template: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None, decode_one: bool = True,
                 **engine_options: Any) -> None:
        if not isinstance(decode_one, bool):
            raise ValueError(f"decode_one must be True or False, got {decode_one!r}")
        for name, value in (("rewind_checkpoints", rewind_checkpoints), ("prefix_cache", prefix_cache),
                            ("prefix_cache_bytes", 0 if prefix_cache_bytes is None else prefix_cache_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.rewind_checkpoints = rewind_checkpoints
        # Turns of a recurrent model that rewound to a checkpoint, and checkpoints not kept for want of room (stats()).
        self._rewinds = self._checkpoints_skipped = 0
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"threads must be an int >= 1, got {threads!r}")
            torch.set_num_threads(threads)
        elif torch.device(device).type == "cpu" and (cpus := usable_cpus()) > 1 and torch.get_num_threads() >= cpus:
            log.warning("LLM on the CPU: torch runs the model's kernels on all %d CPUs, and a kernel waits for its "
                        "slowest thread: other work here (another process, this program's threads) can stall every "
                        "step many times over. LLM(..., threads=%d) leaves one CPU free.", cpus, cpus - 1)
        super().__init__(package, chat_template=chat_template, tool_parser=tool_parser,
                         reasoning_parser=reasoning_parser)
        self.engine = Engine(package, device=device, **engine_options)
        missing = [m for m in ("prefill", "decode") if m not in self.engine.methods]
        if missing or self.engine.pool is None:
            self.engine.close()
            if missing:
                raise PackageError(f"{package}: an LLM package needs methods prefill and decode; "
                                   f"missing {', '.join(missing)} (has {', '.join(self.engine.methods)})")
            raise PackageError(f"{package} was exported before chat sessions shared a batched decode step (its KV "
                               "cache is per session, not pooled); export the model again with this version of "
                               "aoti_sessions.llm.export")
        try:
            self._check_spec()
        except BaseException:
            self.engine.close()
            raise
        eos = self.generation_config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = frozenset(int(t) for t in (*self.spec.eos_token_ids, *eos_ids))
        self._grammars = Grammars(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        budget = engine_options.get("memory_budget")
        if prefix_cache_bytes is None:
            prefix_cache_bytes = budget // 4 if isinstance(budget, int) else DEFAULT_BYTES_WITHOUT_BUDGET
        self.prefix_cache = PrefixCache(self.engine, self.spec.recurrent, prefix_cache, prefix_cache_bytes)
        self._scheduler = Scheduler(self, decode_one=decode_one)

    def _check_spec(self) -> None:
        """llm.json against the compiled package's own shapes: a vocabulary or context larger than
        the model's would let ids or positions past them reach its kernels."""
        where = f"{self.spec.name}: llm.json"
        for method in ("prefill", "decode"):
            for sizes in (self.engine.output_sizes(method) or [])[:1]:  # the logits [rows, V]
                if sizes and sizes[-1] is not None and sizes[-1] != self.spec.vocab_size:
                    raise PackageError(f"{where} says vocab_size {self.spec.vocab_size}, but the compiled "
                                       f"'{method}' returns logits over {sizes[-1]} tokens")
        pool = self.engine.pool
        assert pool is not None
        if self.spec.max_cache_len > int(pool["max_positions"]):
            raise PackageError(f"{where} says max_cache_len {self.spec.max_cache_len}, but the compiled model's "
                               f"cache holds {pool['max_positions']} positions a session")

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def alive(self) -> bool:
        """Whether the LLM serves calls (not closed)."""
        return not self.engine.closed

    def stats(self) -> dict[str, Any]:
        """The engine's counters (:meth:`aoti_sessions.Engine.stats`) and the
        step loop's: ``steps``, ``decode_rows``, ``prefill_calls``,
        ``prefill_rows``, ``prefill_tokens``, and the seconds it spent queueing
        steps (``step_queue_seconds``), waiting for the step before
        (``step_wait_seconds``), and reading its tokens and handing them out
        (``step_text_seconds``: their text included for stop strings, and
        for a callback, which gets text on the step loop's thread), and of the
        queueing, the seconds in the engine's calls (``step_engine_seconds``)
        and the step thread's CPU seconds (``step_queue_cpu_seconds``: the
        rest it waited for the GIL other threads held, or for a lock);
        for recurrent state, the turns that rewound to a checkpoint
        (``checkpoint_rewinds``) and checkpoints not kept for want of room
        (``checkpoints_skipped``); ``prefilling``: generations in the step
        loop still reading their prompt; the prefix cache's
        (:meth:`PrefixCache.stats`)."""
        return {**self.engine.stats(), **self._scheduler.stats(), "checkpoint_rewinds": self._rewinds,
                "checkpoints_skipped": self._checkpoints_skipped, **self.prefix_cache.stats()}

    def new_session(self, prompt: Prompt | None = None, *, cache: str | None = None) -> ChatSession:
        """A chat session with an empty cache (counts against ``max_sessions``).

        With ``cache``, a namespace of the prefix cache (llm/runtime/_prefix.py;
        sessions are shared within one only): the session starts as a fork
        of the namespace's kept session that shares the longest start with
        ``prompt`` (its first turn's, if given; pages shared, nothing
        copied), and once closed it is kept there for later ones."""
        if cache is None:
            if prompt is not None:
                raise TypeError("new_session(prompt) goes with cache=NAMESPACE (the prompt picks a kept session)")
            return ChatSession(self, self.engine.new_session(), [])
        if not isinstance(cache, str):
            raise TypeError(f"cache must be a str (a namespace), got {type(cache).__name__}")
        found = self.prefix_cache.take(self.prompt_ids(prompt), cache) if prompt is not None else None
        session, tokens = found if found is not None else (self.engine.new_session(), [])
        return ChatSession(self, session, tokens, namespace=cache)

    def load_session(self, path: str | os.PathLike[str]) -> ChatSession:
        """A session saved by :meth:`ChatSession.save`: its state and the tokens
        it holds, read from the one file (FileNotFoundError where nothing was
        saved at ``path``; SessionFileError for a file that holds no chat)."""
        where = os.fspath(path)
        if "\0" in where:
            raise ValueError("the session file path holds a NUL byte")
        if not os.path.lexists(where):
            raise FileNotFoundError(errno.ENOENT, "no saved session", where)
        session, attachment = self.engine.load_session_attached(where)
        try:
            tokens, spelling = saved_tokens(where, attachment, self.spec.vocab_size, self.max_context)
            if len(tokens) != session.length:
                raise SessionFileError(f"{where}: holds {len(tokens)} tokens for a state of {session.length} "
                                       "positions")
        except BaseException:
            session.close()
            raise
        return ChatSession(self, session, tokens, spelling)

    def close(self) -> None:
        """Stops the step loop (generations still running end with
        SessionClosedError) and closes the engine and every session."""
        self._scheduler.close()
        self.engine.close()

    def __repr__(self) -> str:
        return f"LLM({self.name!r}, {self.spec.architecture}, context {self.max_context}, {self.engine.device})"


class ChatSession(Closable):
    """One conversation: a session of the engine and the tokens in its cache.
    One generation at a time; its steps may run on any thread."""

    def __init__(self, llm: LLM, session: Session, tokens: list[int], spelling: Spelling | None = None, *,
                 namespace: str | None = None) -> None:
        self._llm = llm
        self._session = session
        self._namespace = namespace  # of the prefix cache, which keeps it once closed
        self._closed = False
        self._id = session.id  # (its session's, for good: the step loop sorts by it every step)
        self._tokens = tokens
        # The text its last chat turn fed and the ids (_prompts.py), and that turn's generation (its reply joins them).
        self._spelling = spelling
        self._last: Generation | None = None
        # Held while the model runs for this session and while its token list changes: forks and saves see both agree.
        self._lock = threading.Lock()
        self._active: Generation | None = None

    @property
    def id(self) -> int:
        return self._id

    @property
    def llm(self) -> LLM:
        return self._llm

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens whose keys and values the cache holds, in order."""
        with self._lock:
            return tuple(self._tokens)

    @property
    def token_count(self) -> int:
        """``len(tokens)``, without waiting for a step in progress."""
        return len(self._tokens)

    @property
    def busy(self) -> bool:
        """Whether a generation is running on this session."""
        return self._active is not None

    @property
    def closed(self) -> bool:
        return self._closed or self._session.closed

    @property
    def resident(self) -> bool:
        return not self._closed and self._session.resident

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")

    def start(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Generation:
        """Begins generating a reply to ``prompt``; run it with :meth:`Generation.step`.
        Keyword arguments are :class:`SamplingParams` fields (instead of ``params``)."""
        params = sampling_params(params, kwargs)
        prepared = self._llm.prepare(prompt)
        with self._lock:
            if self._active is not None:
                raise SessionBusyError(f"session {self.id} is busy: a generation is running on it")
            self._check_open()
            # Chat messages: the ids this session fed for the text they start with, if any, not those text's again.
            ids, spelling = self._llm._respell(self._spelled(), prepared) if isinstance(prepared, ChatPrompt) \
                else (prepared, None)
            generation = Generation(self, ids, params)
            self._active = generation
            self._spelling, self._last = spelling, generation
        try:
            generation.submitted = time.perf_counter()
            self._llm._scheduler.submit(generation)
        except BaseException:
            self._release(generation)
            raise
        return generation

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """The whole reply to ``prompt``."""
        with self.start(prompt, params, **kwargs) as g:
            while g.step() is not None:
                pass
            return g.completion()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Iterator[str]:
        """The reply to ``prompt``, piece by piece; closing the iterator stops it."""
        with self.start(prompt, params, **kwargs) as g:
            while (piece := g.step()) is not None:
                if piece:
                    yield piece

    def _keep(self, keep: int) -> int:
        """At the start of a turn (locked): forgets the tokens from ``keep``
        on (at most the session's) and returns how many stay. Recurrent state
        goes back to its latest checkpoint at most ``keep``, or empty; then
        (recurrent) it is checkpointed there, the start of this turn (and
        again at its prompt's end: :meth:`_prompt_fed`)."""
        llm = self._llm
        if keep < len(self._tokens):
            if not llm.spec.recurrent:
                self._session.truncate(keep)
            elif (back := max((c for c in self._session.checkpoints if c <= keep), default=0)) > 0:
                self._session.truncate(back)
                llm._rewinds += 1
                keep = back
            else:
                self._session.reset()
                keep = 0
            del self._tokens[keep:]
        if llm.spec.recurrent and llm.rewind_checkpoints and keep:
            self._checkpoint()
        return keep

    def _checkpoint(self) -> None:
        """(Locked, recurrent state) keeps the state at the session's length
        to rewind to: two a turn (its start, its prompt's end) for the last
        ``rewind_checkpoints`` turns."""
        llm = self._llm
        try:
            self._session.checkpoint(2 * llm.rewind_checkpoints)
        except CapacityError:  # no room: an edit after it feeds more again
            llm._checkpoints_skipped += 1

    def _prompt_fed(self, generation: Generation) -> None:
        """(The step loop's, once the first token of ``generation`` is read)
        Recurrent state is checkpointed at the prompt's end, where a reply
        that comes back changed (edited, or its thinking dropped by the chat
        template) diverges: the next turn rewinds there instead of feeding
        the whole history again. (A recurrent model's sampled token is fed
        once read, so the state is the prompt's here.)"""
        llm = self._llm
        if not (llm.spec.recurrent and llm.rewind_checkpoints):
            return
        with self._lock:
            if self._active is generation and not generation.finished \
                    and len(self._tokens) == generation.prompt_tokens:
                self._checkpoint()

    def _spelled(self) -> Spelling | None:
        """(Locked) The text the last chat turn fed and its ids, its reply
        included once it ended."""
        last = self._last
        if last is not None and last.finished:
            self._last = None
            if self._spelling is not None:
                self._spelling = self._llm._with_reply(self._spelling, list(last.token_ids), last.text)
        return self._spelling

    def _idle(self, what: str) -> None:
        if self._active is not None:
            raise SessionBusyError(f"session {self.id} is busy: cannot {what} while a generation runs")

    def reset(self) -> None:
        """Empties the cache."""
        with self._lock:
            self._idle("reset")
            self._check_open()
            self._session.reset()
            self._tokens = []
            self._spelling = self._last = None

    def fork(self) -> ChatSession:
        """A new session holding a copy of this one's cache and tokens."""
        with self._lock:
            self._check_open()
            return ChatSession(self._llm, self._session.fork(), list(self._tokens), self._spelled())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the state and the tokens it holds to one session file at
        ``path`` (atomically: the two always agree), for :meth:`LLM.load_session`.
        The session is held only while its state is copied out (between two
        steps of a generation running on it, if one is): it runs on while
        the file is written."""
        with self._lock:
            self._check_open()
            tokens = chat_attachment(self._tokens, self._spelled())
            snapshot = self._session.snapshot()
        snapshot.write(path, tokens)

    def close(self) -> None:
        """Stops a running generation and frees the state (a session with a
        namespace goes to the prefix cache instead, unless its last turn
        failed); idempotent."""
        active = self._active
        if active is not None:
            active.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failed = self._last is not None and self._last._error is not None
            if self._namespace is None or failed \
                    or not self._llm.prefix_cache.keep(self._session, self._tokens, self._namespace):
                self._session.close()

    # -- the step loop's (through Generation, its session's lock held: Held) --
    def _took(self, tokens: list[int], width: int) -> None:
        """A call fed ``tokens`` in ``width`` positions: the token list gains
        them and the cache forgets the padding's positions."""
        if len(tokens) < width:
            self._session.truncate(len(self._tokens) + len(tokens))
        self._tokens.extend(tokens)

    def _settle(self, token: int, keep: bool) -> None:
        """The token a step fed before it was read, now read: the token list
        gains it (``keep``) or the cache forgets it; then the lock that step
        kept (Held.keep) goes, whatever happens."""
        try:
            if keep:
                self._tokens.append(token)
            else:
                self._session.truncate(len(self._tokens))
        finally:
            self._lock.release()

    def _release(self, generation: Generation) -> None:
        if self._active is generation:
            self._active = None

    def __repr__(self) -> str:
        return f"ChatSession(id={self.id}, {len(self._tokens)} tokens{', busy' if self.busy else ''})"
