"""The OpenAI response bodies and stream chunks of a generation request
(_generate.Job): its choices' text, reasoning and tool calls (read by the
model's reply format: llm/runtime/_replies.py), logprobs (_logprobs.py) and usage."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._logprobs import TokenTexts, chat_logprobs, completion_logprobs
from ._protocol import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from ..llm import ReplyStream, ToolCall
    from ._model import ServedGeneration, ServedLLM
    from ..llm.interface import TokenLogprob
    from ._entry import Entry

__all__ = ["Bodies", "Choice", "DONE"]


class Choice:
    """One choice of a request: its generation (on the request's session, or
    for a choice after the first of ``n``, on a fork of it), its reply read in
    pieces (its reasoning and tool calls, where the model's reply format
    reads any; else None) and what it has reported so far."""

    def __init__(self, index: int, generation: ServedGeneration, session: Any,
                 reply: ReplyStream | None) -> None:
        self.index, self.generation, self.session, self.reply = index, generation, session, reply
        self.calls_out = 0  # (streamed) tool calls given out
        self.pending: list[str] = []  # text of the events of this wake not yet yielded
        self.text: list[str] = []  # (not streamed) the whole text, piece by piece
        self.count = 0  # tokens generated, as of its last event
        self.sent = 0  # of its logprobs, those handed out (streamed)
        self.offset = 0  # (completions) the text offset of its next token's logprobs
        self.done = False

    def logprobs_since(self) -> list[TokenLogprob]:
        """The logprobs of its tokens since the last call (up to its last event's count)."""
        logprobs = self.generation.logprobs
        if logprobs is None or self.sent >= self.count:
            return []
        out, self.sent = logprobs[self.sent:self.count], self.count
        return out


class Bodies:
    """What a generation request answers, made from its state (the job's)."""

    llm: ServedLLM
    id: str
    created: int
    model: str
    chat: bool
    request: ChatRequest | CompletionRequest
    entry: Entry | None
    choices: list[Choice]
    prefill: ServedGeneration | None
    texts: TokenTexts | None
    _piece_frames: dict[int, tuple[bytes, bytes]]

    def usage(self) -> dict[str, Any]:
        read = self.prefill if self.prefill is not None else self.choices[0].generation
        completion = sum(c.generation.completion_tokens for c in self.choices)
        return {"prompt_tokens": read.prompt_tokens, "completion_tokens": completion,
                "total_tokens": read.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": read.cached_tokens}}

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.entry is not None and self.entry.id is not None:
            body["session_id"] = self.entry.id
        return body

    @staticmethod
    def finish_reason(c: Choice) -> str | None:
        """Its generation's, or "tool_calls" where it stopped after calling tools."""
        reason = c.generation.finish_reason
        return "tool_calls" if reason == "stop" and c.reply is not None and c.reply.calls else reason

    def _logprobs(self, c: Choice, logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """A choice's (or chunk's) ``logprobs`` body, of ``logprobs`` (None: none asked)."""
        if logprobs is None or self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, logprobs)
        body, c.offset = completion_logprobs(self.texts, logprobs, c.offset)
        return body

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            logprobs = c.generation.logprobs
            choice: dict[str, Any] = {"index": c.index, "finish_reason": None, "logprobs": self._logprobs(c, logprobs)}
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if c.reply is not None:
                    from ..llm import Reasoning

                    pieces = [*c.reply.push(text), *c.reply.finish()]
                    content = "".join(p for p in pieces if isinstance(p, str))
                    calls = [self._call(p) for p in pieces if not isinstance(p, (str, Reasoning))]
                    message = {"role": "assistant", "content": content if content.strip() or not calls else None}
                    if self.llm.reply_format.reasoning is not None:
                        thoughts = [p.text for p in pieces if isinstance(p, Reasoning)]
                        message["reasoning_content"] = "".join(thoughts) if thoughts else None
                    if calls:
                        message["tool_calls"] = calls
                choice["message"] = message
            else:
                choice["text"] = text
            choice["finish_reason"] = self.finish_reason(c)
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = self.usage()
        return body

    def _call(self, call: ToolCall) -> dict[str, Any]:
        tools = self.llm.reply_format.tools  # (its ids are the kind its template takes back)
        return {"id": tools.call_id() if tools is not None else "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def stream_chunks(self, c: Choice, piece: str | None) -> list[bytes]:
        """The stream's chunks for a piece of choice ``c``'s text (None: its
        end, what is held back): the piece itself, or where its reply is read
        its text, reasoning (``reasoning_content`` deltas) and calls (a call
        as one ``tool_calls`` delta, once it is whole); the logprobs of its
        tokens since the chunk before go with the first."""
        logprobs = c.logprobs_since() if self.texts is not None else None
        if c.reply is None:
            return [self.piece_chunk(c, piece, logprobs)] if piece is not None or logprobs else []
        from ..llm import Reasoning

        out = []
        for p in c.reply.push(piece) if piece is not None else c.reply.finish():
            if isinstance(p, str):
                out.append(self.piece_chunk(c, p, logprobs))
            elif isinstance(p, Reasoning):
                out.append(self._delta(c, {"reasoning_content": p.text}, logprobs))
            else:
                out.append(self._delta(c, {"tool_calls": [{"index": c.calls_out, **self._call(p)}]}, logprobs))
                c.calls_out += 1
            logprobs = None
        if logprobs:
            out.append(self.piece_chunk(c, "", logprobs))
        return out

    def _delta(self, c: Choice, delta: dict[str, Any], logprobs: list[TokenLogprob] | None) -> bytes:
        body = self._envelope(self._chunk_kind, [{"index": c.index, "finish_reason": None,
                                                  "logprobs": self._logprobs(c, logprobs), "delta": delta}])
        if self.request.include_usage():
            body["usage"] = None
        return _event(body)

    def piece_chunk(self, c: Choice, text: str | None, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """``chunk(c, text)``, from the event's bytes around the text, made
        once a choice (the hot path: one a generated piece); with logprobs,
        made whole."""
        if logprobs is not None:
            return self.chunk(c, text, logprobs=logprobs)
        frame = self._piece_frames.get(c.index)
        if frame is None:
            sentinel = "\x00piece\x00"
            # The text is the last field that can hold it (a session id cannot; a model name before it can).
            head, _, tail = self.chunk(c, sentinel).rpartition(json.dumps(sentinel).encode())
            frame = self._piece_frames[c.index] = (head, tail)
        head, tail = frame
        return head + json.dumps(text or "").encode() + tail

    def chunk(self, c: Choice, text: str | None, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": finish_reason,
                                  "logprobs": self._logprobs(c, logprobs)}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = self._envelope(self._chunk_kind, [choice])
        if self.request.include_usage():
            body["usage"] = None
        return _event(body)

    def usage_chunk(self) -> bytes:
        body = self._envelope(self._chunk_kind, [])
        body["usage"] = self.usage()
        return _event(body)

    @property
    def _chunk_kind(self) -> str:
        """The ``object`` of a stream chunk (OpenAI streams completions as ``text_completion``)."""
        return "chat.completion.chunk" if self.chat else "text_completion"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
