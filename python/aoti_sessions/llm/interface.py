"""What aoti_sessions.serve and aoti_sessions.cluster use of ``llm`` beyond
its documented API (``aoti_sessions.llm``): public inside the package, so that
no sibling reaches into llm's private modules, and one place says what the
server depends on (the engine process's deadlines and address, the prompt and
parameter types, the package spec)."""

from __future__ import annotations

from ._spec import HUB_ID, LLMSpec
from .process._remote import ENGINE_TIMEOUT_S, STEP_TIMEOUT_S
from .process._remote_engine import SWITCH_INTERVAL_S, portable
from .process._remote_wire import EngineAddress
from .runtime._generation import Event
from .runtime._llm import usable_cpus
from .runtime._logprobs import TokenLogprob
from .runtime._params import ParamError, SamplingParams, generation_defaults
from .runtime._prompts import TEMPLATE_CALL_ARGS, ChatPrompt, Prompt
from .runtime._replies import ReplyFormat

__all__ = ["ChatPrompt", "ENGINE_TIMEOUT_S", "EngineAddress", "Event", "HUB_ID", "LLMSpec", "ParamError",
           "Prompt", "ReplyFormat", "STEP_TIMEOUT_S", "SWITCH_INTERVAL_S", "SamplingParams",
           "TEMPLATE_CALL_ARGS", "TokenLogprob", "generation_defaults", "portable", "usable_cpus"]
