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

from ._export import export
from ._generation import Completion, Generation
from ._grammar import Constraint
from ._llm import LLM, ChatSession, ContextLengthError, Prompt
from ._logprobs import TokenLogprob
from ._params import ParamError, SamplingParams
from ._reasoning import Reasoning
from ._remote import EngineProcessError, EngineUnresponsiveError, RemoteLLM
from ._remote_session import RemoteGeneration, RemoteSession
from ._replies import Reply, ReplyFormat, ReplyStream, ToolCallStream, parse_tool_calls, tool_call_constraint
from ._tools import ToolCall

__all__ = ["export", "LLM", "ChatSession", "Completion", "Generation", "Prompt", "SamplingParams", "ParamError",
           "TokenLogprob", "Constraint",
           "ContextLengthError", "ToolCall", "ToolCallStream", "parse_tool_calls", "tool_call_constraint",
           "Reasoning", "Reply", "ReplyFormat", "ReplyStream",
           "RemoteLLM", "RemoteSession", "RemoteGeneration", "EngineProcessError", "EngineUnresponsiveError"]
