"""Continuous batching (docs/batching.md): one step loop per LLM that runs
every chat's generation together.

Each step runs one batched ``decode`` over every generation that has a token
to feed (the one it sampled last, or the last token of its prompt), then
prefill chunks of generations still reading their prompt, FCFS, up to a
token budget (a long prompt is fed over several steps and never stalls the
others; a new chat's first token waits for one step, not for the others to
finish), several sessions' chunks in one call where the package allows,
samples every row at once on the device, each with its own parameters, and
reads the sampled tokens with one copy. Generations join and leave between
steps. Where prefill runs as CUDA graphs (captured per shape), its chunks
are padded to powers of two, so a few graphs serve every length.

The loop runs a step ahead of what it has read: each step is queued while
the device still computes the one before, feeding that step's sampled
tokens (still on the device) to every generation whose next token the host
knows it will feed unless it is a stop token (max_tokens and the context
are counted on the host). Then the loop reads the step before, and while
the device runs the new one, records its tokens and hands them out (their
text is made where they are read: _generation.py; only stop strings are
looked for here). The host's work a step thus overlaps the
device's instead of adding to it. A token fed ahead that turns out to end
the reply (a stop token, or a generation closed meanwhile) is taken back
out of the cache (a truncation) and its row's sample dropped; until a
session's fed token is read, the scheduler holds the session's lock (a fork
or save sees the cache and the token list agree). Only a stop string can
end a generation after its token was fed, and then the fed token is one
the reply keeps.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...errors import SessionClosedError
from ._generation import Held
from ._grammar import Masks
from ._plan import Limits, Plan, Row, plan_step, prefill_width
from ._logprobs import StepLogprobs, TokenLogprob
from ._penalties import Penalties
from ._sampling import draw
from .._spec import PAD_ID

if TYPE_CHECKING:
    from ._generation import Generation
    from ._roles import StepModel

__all__ = ["Scheduler"]

# Step loops running now: stopped at interpreter exit (an LLM left open must
# not step while the interpreter finalizes: its tensors would be freed under it).
_running: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_running_loops() -> None:
    for scheduler in list(_running):
        scheduler.close()


# The shortest padded prefill chunk where prefill runs as CUDA graphs (on the
# device a call of 16 tokens costs what one of 2 does).
MIN_PREFILL_BUCKET = 16


@dataclass
class _Step:
    """What one step queued: the rows whose tokens it samples, in order, and
    where those tokens arrive on the host."""

    sampled: list[Generation] = field(default_factory=list)
    tokens: torch.Tensor | None = None   # [len(sampled)] on the device: the next step's inputs
    host: torch.Tensor | None = None     # pinned (CUDA) copy of them
    done: Any = None                     # CUDA event once they are there
    # Logits whose sampling waits for the step before to be handed out: a
    # constrained row's mask needs the token before (_grammar.py).
    logits: torch.Tensor | None = None
    # The logprobs of the rows that ask (on the device; copied with the tokens), then read: by row.
    logprobs: StepLogprobs | None = None
    read: dict[int, TokenLogprob] | None = None


class Scheduler:
    """The step loop of one LLM (a thread, started with the first generation)."""

    def __init__(self, llm: StepModel, decode_one: bool = True) -> None:
        self._llm = llm
        self._engine = llm.engine
        pool = self._engine.pool
        assert pool is not None
        self.max_rows = int(pool["max_rows"])
        self._cuda = self._engine.device.type == "cuda"
        # A lone chat's step, where the package compiled one (export's decode_one) and the LLM's decode_one
        # lets it: its one-row kernels.
        self._decode_one = "decode_one" if decode_one and "decode_one" in self._engine.methods else "decode"
        # Sessions one prefill call feeds (packages made before batched prefill: 1).
        prefill_rows = min(llm.spec.prefill_rows, self.max_rows)
        # Prompt tokens fed per step at most. On CUDA a prefill call costs about the same for a few hundred
        # tokens as for a few (launches, weight reads): up to four calls' worth, so a burst of new turns is
        # read in one step; on the CPU its cost grows with the tokens: one.
        budget = llm.spec.max_prefill * (min(4, prefill_rows) if self._cuda else 1)
        # What bounds a step's plan (_plan.py; tests replace it to vary the budget).
        self.limits = Limits(budget, llm.spec.max_prefill, prefill_rows, llm.max_context, MIN_PREFILL_BUCKET)
        self._cond = threading.Condition()
        self._waiting: deque[Generation] = deque()  # submitted, not yet stepped
        self._active: list[Generation] = []         # stepped: reading their prompt or decoding
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(self._engine.device) if self._cuda else None  # type: ignore[no-untyped-call]
        # (CUDA) Where steps' sampled tokens land on the host: two pinned buffers with their events, taken in
        # turn (a step's tokens are read before the step after next is queued), made once, not every step.
        self._landing: list[tuple[torch.Tensor, Any] | None] = [None, None]
        self._landed = 1
        self._masks = Masks()  # structured output's (_grammar.py)
        self.penalties = Penalties(self._engine.device)  # the token counts of rows with penalties (_penalties.py)
        self.steps = 0  # steps run (for tests and metrics)
        self.decode_rows = 0  # rows of the batched decode calls
        self.prefill_calls = 0  # prefill calls made, the rows and tokens they fed
        self.prefill_rows_fed = 0
        self.prefill_tokens = 0
        # Where the loop's time goes, in seconds: queueing a step (the host's
        # work, while the device computes the step before), waiting for the
        # step before to end, reading its tokens and handing them out ("text":
        # their text is made where they are read, here only for stop strings
        # and for callbacks, which take text on this thread).
        self.wait_seconds = 0.0
        self.queue_seconds = 0.0
        self.text_seconds = 0.0
        self.engine_seconds = 0.0  # of queue_seconds: in the engine's calls (inputs to launches, in C++)
        # Of queue_seconds, this thread's CPU time; the rest it waited: for the
        # GIL (other threads of the process), a lock, or the device's queue.
        self.queue_cpu_seconds = 0.0
        # Called on the loop's thread when it is about to wait (for the device,
        # or for work): where a process's other threads may take the GIL
        # without holding up the queueing of a step (_remote_engine.py).
        self.before_wait: list[Callable[[], None]] = []

    def stats(self) -> dict[str, float]:
        """The step loop's counters (LLM.stats()), and how many of its
        generations are still reading their prompt (``prefilling``: no
        token generated yet)."""
        with self._cond:
            prefilling = sum(1 for g in (*self._waiting, *self._active) if not g.token_ids and not g.finished)
        return {"prefilling": prefilling, "steps": self.steps, "decode_rows": self.decode_rows, "prefill_calls": self.prefill_calls,
                "prefill_rows": self.prefill_rows_fed, "prefill_tokens": self.prefill_tokens,
                "step_wait_seconds": self.wait_seconds, "step_queue_seconds": self.queue_seconds,
                "step_text_seconds": self.text_seconds, "step_engine_seconds": self.engine_seconds,
                "step_queue_cpu_seconds": self.queue_cpu_seconds}

    # -- from other threads ----------------------------------------------------
    def submit(self, generation: Generation) -> None:
        with self._cond:
            if self._closed:
                raise SessionClosedError("the LLM is closed")
            self._waiting.append(generation)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="aoti-sessions-steps", daemon=True)
                self._thread.start()
                _running.add(self)
            self._cond.notify()

    def cancel(self, generation: Generation) -> None:
        """Takes ``generation`` out before the next step (waiting for the step in flight)."""
        with self._cond:
            if generation in self._waiting:
                self._waiting.remove(generation)
                generation._released.set()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            generation._released.wait()

    def close(self) -> None:
        """Stops the loop; generations still running end with SessionClosedError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the loop --------------------------------------------------------------
    def _loop(self) -> None:
        stream: AbstractContextManager[Any] = torch.cuda.stream(self._stream) if self._stream is not None \
            else nullcontext()
        with torch.no_grad(), stream:
            previous: _Step | None = None
            while True:
                with self._cond:
                    idle = self._idle(previous)
                if idle:
                    self._waiting_now()
                with self._cond:
                    while self._idle(previous):
                        self._cond.wait()
                    if self._closed:
                        break
                    self._active.extend(self._waiting)
                    self._waiting.clear()
                # Queued while the device computes the step before; then that
                # step's tokens are read and their text made while this one runs.
                started, cpu = time.perf_counter(), time.thread_time()
                step = self._run_step(previous)
                queued = time.perf_counter()
                self.queue_cpu_seconds += time.thread_time() - cpu
                self._waiting_now()
                tokens = self._read(previous)
                read = time.perf_counter()
                if step.logits is not None:  # (its masks need the tokens just read: they go first)
                    if previous is not None:
                        for g, token in zip(previous.sampled, tokens):
                            if g._guide is not None and not g.finished:
                                g._guide_token(token)
                    self._sample(step, guided=True)
                if previous is not None:
                    self._hand_out(previous, tokens)
                self._drop_finished()
                previous = step if step.sampled else None
                self.steps += 1
                done = time.perf_counter()
                self.queue_seconds += queued - started
                self.wait_seconds += read - queued
                self.text_seconds += done - read
        self._end_all(SessionClosedError("the LLM was closed while generating"))
        self._waiting_now()  # (what the ends handed out)

    def _idle(self, previous: _Step | None) -> bool:
        """(Under _cond) Whether the loop has nothing to do: open, no generation and no step in flight."""
        return not self._closed and not self._waiting and not self._active and previous is None

    def on_loop(self) -> bool:
        """Whether the calling thread is the step loop's."""
        return threading.current_thread() is self._thread

    def _waiting_now(self) -> None:
        """The loop is about to wait: for the device (after queueing a step) or for work."""
        for hook in self.before_wait:
            hook()

    def _read(self, step: _Step | None) -> list[int]:
        if step is None or step.tokens is None:
            return []
        if step.done is not None:
            step.done.synchronize()  # releases the GIL while the device finishes
            assert step.host is not None
            tokens: list[int] = step.host[: len(step.sampled)].tolist()
            if step.logprobs is not None:
                step.read = step.logprobs.read(step.host, tokens)
            return tokens
        tokens = step.tokens.tolist()
        if step.logprobs is not None:
            step.read = step.logprobs.here(tokens)
        return tokens

    def _hand_out(self, step: _Step, tokens: list[int]) -> None:
        """Records each sampled token (the step after was queued: where it fed
        the token, this settles it and frees the session's lock), then hands
        it out (Generation._take_token), with its logprobs where asked."""
        if step.read is None:
            for g, token in zip(step.sampled, tokens):
                g._take_token(token)
            return
        logprobs = step.read
        for i, (g, token) in enumerate(zip(step.sampled, tokens)):
            g._take_token(token, logprobs.get(i))

    def _drop_finished(self) -> None:
        with self._cond:
            kept = []
            for g in self._active:
                if g.finished:
                    g._sampler.release()  # (its slot of penalties, if any: the steps queued so far used it)
                    g._released.set()
                else:
                    kept.append(g)
            self._active = kept

    def _run_step(self, previous: _Step | None) -> _Step:
        """Queues the step plan_step decides (_plan.py): the batched decode,
        then the prefill calls. A generation the step before sampled for
        feeds that token (unread) if it goes on unless the token is a stop
        token."""
        plan: Plan = plan_step(self._active, previous.sampled if previous is not None else (), self.limits)
        decode = plan.decode
        step = _Step()
        logits: list[torch.Tensor] = []
        for start in range(0, len(decode), self.max_rows):
            rows = decode[start:start + self.max_rows]
            out = self._decode(rows, previous)  # (rows: those that ran)
            if out is not None:
                # A one-token chunk within a prompt runs as a decode row,
                # but its logits pick nothing: only rows that sample join.
                sampling = [i for i, r in enumerate(rows) if r.samples]
                if len(sampling) < len(rows):
                    out = out[_host_to(sampling, out.device)] if sampling else None
                if out is not None:
                    logits.append(out)
                    step.sampled.extend(rows[i].generation for i in sampling)
        for group in plan.prefill:
            for row, out in zip(group, self._prefill(group)):
                if out is not None and row.samples:
                    logits.append(out)
                    step.sampled.append(row.generation)
        if logits:
            step.logits = logits[0] if len(logits) == 1 else torch.cat(logits)
            if not any(g._guide is not None for g in step.sampled):
                self._sample(step, guided=False)
        return step

    def _sample(self, step: _Step, guided: bool) -> None:
        """Queues the sampling of a step's logits (masked first where
        ``guided``: a row's generation has a constraint) and the copy of its
        tokens to the host."""
        assert step.logits is not None
        logits, step.logits = step.logits, None
        if guided:
            self._masks.apply(logits, [g._guide if not g.finished else None for g in step.sampled])
        step.tokens, step.logprobs = draw(logits, [g._sampler for g in step.sampled])
        if self._cuda:
            step.host, step.done = self._land(step.tokens if step.logprobs is None
                                              else step.logprobs.packed(step.tokens))

    def _land(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queues the copy of a step's sampled ``tokens`` (and the logprobs
        packed after them) to the host: the pinned buffer they land in and
        the event recorded after the copy."""
        slot = self._landed = 1 - self._landed
        count = tokens.numel()
        landing = self._landing[slot]
        if landing is None or landing[0].numel() < count:
            landing = self._landing[slot] = (torch.empty(max(count, self.max_rows), dtype=torch.int64, pin_memory=True),
                                             torch.cuda.Event())  # type: ignore[no-untyped-call]
        buffer, event = landing
        buffer[:count].copy_(tokens, non_blocking=True)
        event.record()
        return buffer, event

    def _decode(self, rows: list[Row], previous: _Step | None) -> torch.Tensor | None:
        device = self._engine.device
        ids = self._inputs(rows, previous, device)
        sessions = [r.generation._session for r in rows]
        try:
            with Held(sessions) as locked:
                called = time.perf_counter()
                method = self._decode_one if len(rows) == 1 else "decode"
                out: torch.Tensor = self._engine.run_batch(method, [s._session for s in sessions], ids)
                self.engine_seconds += time.perf_counter() - called
                self.decode_rows += len(rows)
                for r, s in zip(rows, sessions):
                    if r.fed:
                        r.generation._took(r.fed, 1)
                    else:  # the unread token: its session stays held until it is read
                        r.generation._took_unread()
                        locked.keep(s)
            return out
        except Exception as e:  # noqa: BLE001 - one row's failure must not end the others
            if len(rows) == 1:
                rows[0].generation._fail(e)
                return None
        # Which row failed: each alone (the others' results are then fine to use).
        outs = []
        kept = []
        for r in rows:
            out1 = self._decode([r], previous)
            if out1 is not None:
                outs.append(out1)
                kept.append(r)
        rows[:] = kept
        return torch.cat(outs) if outs else None

    def _inputs(self, rows: list[Row], previous: _Step | None, device: torch.device) -> torch.Tensor:
        """[B, 1] token ids: the previous step's sampled tokens where the row
        continues (no trip through the host), the fed tokens otherwise."""
        if previous is not None and previous.tokens is not None and all(r.from_device >= 0 for r in rows):
            picks = [r.from_device for r in rows]
            if picks == list(range(len(picks))):
                return previous.tokens[: len(picks)].view(-1, 1)
            return previous.tokens[_host_to(picks, device)].view(-1, 1)
        parts = []
        for r in rows:
            if r.from_device >= 0:
                assert previous is not None and previous.tokens is not None
                parts.append(previous.tokens[r.from_device: r.from_device + 1])
            else:
                parts.append(_host_to(r.fed, device))
        return torch.cat(parts).view(-1, 1)

    def _prefill(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """Feeds ``rows``' chunks in one call, right-padded to the longest;
        each row's logits [1, V], or None where the row failed (its
        generation ends with the error; the others' are fine to use)."""
        width = self._width(rows)
        sessions = [r.generation._session for r in rows]
        try:
            with Held(sessions):
                ids = [t for r in rows for t in (*r.fed, *[PAD_ID] * (width - len(r.fed)))]
                inputs = _host_to(ids, self._engine.device).view(len(rows), width)
                called = time.perf_counter()
                if len(rows) == 1:
                    out: torch.Tensor = sessions[0]._session.run("prefill", inputs)
                else:
                    out = self._engine.run_batch("prefill", [s._session for s in sessions], inputs)
                self.engine_seconds += time.perf_counter() - called
                for r in rows:
                    r.generation._took(r.fed, width)
            self.prefill_calls += 1
            self.prefill_rows_fed += len(rows)
            self.prefill_tokens += sum(len(r.fed) for r in rows)
            return [out[i:i + 1] for i in range(len(rows))]
        except Exception as e:  # noqa: BLE001 - one row's failure must not end the others
            if len(rows) == 1:
                rows[0].generation._fail(e)
                return [None]
        return [self._prefill([r])[0] for r in rows]  # which row failed: each alone

    def _width(self, rows: list[Row]) -> int:
        """The length ``rows``' chunks are padded to (_plan.prefill_width):
        buckets where prefill runs as CUDA graphs (captured per shape), but
        for recurrent state, which would take in the padding."""
        buckets = self._cuda and self._engine.captures("prefill") and not self._llm.spec.recurrent
        return prefill_width(rows, self.limits, buckets)

    def _end_all(self, error: BaseException) -> None:
        with self._cond:
            everyone = [*self._active, *self._waiting]
            self._active, self._waiting = [], deque()
        for g in everyone:
            if not g.finished:
                g._fail(error)
            g._sampler.release()
            g._released.set()


def _host_to(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, copied without a host
    synchronisation (from pinned memory on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
