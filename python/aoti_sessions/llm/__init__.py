"""Large language models on aoti_sessions.

``export`` turns a transformers causal LM into one package (prefill and decode
methods, weights once, a static KV cache per session, the tokenizer and
generation config inside); ``LLM`` loads it, and its chat sessions generate,
remembering the tokens in their cache between turns. ``RemoteLLM`` runs the
same in a process of its own (what ``aoti-sessions serve`` does), keeping the
tokenizer and proxies here. A reply's text is read in pieces (its answer,
``Reasoning``, ``ToolCall``) by its model's ``ReplyFormat`` (``llm.reply_format``).

>>> from aoti_sessions.llm import LLM, export
>>> export("path/to/hf-model", "model.pt2")
>>> llm = LLM("model.pt2")
>>> with llm.new_session() as chat:
...     chat.generate([{"role": "user", "content": "Hi"}], max_tokens=32).text
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .process._remote import EngineProcessError, EngineUnresponsiveError, RemoteLLM
from .process._remote_session import RemoteGeneration, RemoteSession
from .runtime._generation import Completion, Generation
from .runtime._grammar import Constraint
from .runtime._llm import LLM, ChatSession, ContextLengthError, Prompt
from .runtime._logprobs import TokenLogprob
from .runtime._params import ParamError, SamplingParams
from .runtime._reasoning import Reasoning
from .runtime._replies import Reply, ReplyFormat, ReplyStream, ToolCallStream, parse_tool_calls, tool_call_constraint
from .runtime._tools import ToolCall

if TYPE_CHECKING:
    from .exporting._export import export

__all__ = ["export", "LLM", "ChatSession", "Completion", "Generation", "Prompt", "SamplingParams", "ParamError",
           "TokenLogprob", "Constraint",
           "ContextLengthError", "ToolCall", "ToolCallStream", "parse_tool_calls", "tool_call_constraint",
           "Reasoning", "Reply", "ReplyFormat", "ReplyStream",
           "RemoteLLM", "RemoteSession", "RemoteGeneration", "EngineProcessError", "EngineUnresponsiveError"]


def __getattr__(name: str) -> Any:
    """``export`` on first use: export time's modules (llm/exporting/) stay out of a process that only serves."""
    if name == "export":
        from .exporting._export import export
        return export
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
