"""Request bodies of the OpenAI-compatible endpoints, checked strictly: an
unknown field, a wrong type (``"5"`` for a number) or a value out of range is
a 400 naming the field.

Fields OpenAI's clients send on their own, or that callers commonly pass, are
accepted where their value asks for nothing this server does not do:
``user`` (ignored), ``stream_options`` (``include_usage`` honoured),
``echo``: false, ``best_of``: 1, ``suffix``: null. Any other value of these
is a 400 saying it is not supported. ``response_format`` (chat): text,
json_object or json_schema, held to by the grammar engine (llm/runtime/_grammar.py);
``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls``
and ``tool`` messages (llm/runtime/_replies.py); ``reasoning_effort``,
``chat_template_kwargs`` (the chat template's variables, as vLLM takes them)
and assistant ``reasoning_content`` (given to the template, which may render
it). Sampling (llm/runtime/_params.py):
``presence_penalty`` / ``frequency_penalty``, ``logit_bias`` (token ids as
strings, OpenAI's), ``n`` (forks of the prompt's session: _generate.py),
logprobs (chat: ``logprobs`` and ``top_logprobs``; completions:
``logprobs`` N).
Fields that ask for nothing of this server are accepted, checked as OpenAI
checks them, and ignored (:class:`NoOpFields`: ``metadata``, ``store``,
``service_tier``, ``safety_identifier``, ``modalities: ["text"]``;
``stream_options.include_obfuscation``).
``prompt_cache_key``: a request without a session id shares cached prefixes
only with requests of its key and the same ``prompt_cache_key``.
Extensions (vLLM's): ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``; and ``session_id``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN (which Python's JSON reader takes) is refused as not a finite number.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # (OpenAI's padding against size side channels: none is added)


class NoOpFields(_Strict):
    """OpenAI's request fields that change nothing here, accepted (and
    checked as OpenAI checks them) so that clients that send them work:
    ``metadata`` (tags for OpenAI's dashboard), ``store`` (keep the
    completion for OpenAI's evals), ``service_tier``, ``safety_identifier``
    (who the end user is, for abuse detection), ``modalities`` (text only)."""

    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(default=None, max_length=64)
    safety_identifier: str | None = Field(default=None, max_length=64)
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class CalledFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted, not shown to the model
    tool_calls: list[ToolCallMessage] | None = Field(default=None, max_length=128)  # (assistant)
    tool_call_id: str | None = Field(default=None, max_length=256)  # (tool)
    reasoning_content: str | None = None  # (assistant) its reasoning, as the server gave it

    @model_validator(mode="after")
    def _parts(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message has a tool_call_id, and only a tool message")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only an assistant message has reasoning_content")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (a call's arguments as an object where they are one)."""
        content = self.content
        text = content if isinstance(content, str) or content is None else "".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:  # (Qwen3's template reads reasoning_content; GPT-OSS's, thinking)
            out["reasoning_content"] = out["thinking"] = self.reasoning_content
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (a required call is always held to its parameters)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: str


class ToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # (the schema is always held to)


class ResponseFormat(_Strict):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (JSON
    valid against ``json_schema.schema``; none: any JSON object)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def constraint(self) -> Any:
        """The llm's Constraint for this format (None for text); ValueError
        for a schema the grammar engine refuses."""
        from ..llm import Constraint

        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return Constraint.json_object() if schema is None else Constraint.json_schema(schema)


def _unsupported(value: Any, allowed: str) -> ValueError:
    return ValueError(f"only {allowed} is supported, got {value!r}")


MAX_CHOICES = 16  # n at most (each choice a fork of the prompt's session: room for them is the engine's)
MAX_LOGPROBS = 20  # top_logprobs (completions: logprobs) at most, OpenAI's limit
MAX_LOGIT_BIAS = 1024  # logit_bias entries at most (llm/runtime/_params.py's)
MAX_STOP_TOKEN_IDS = 64


class _Generate(_Strict):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # extension: 0 means no limit
    ignore_eos: bool = False  # extension (as vLLM's): generate past end-of-sequence tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_p: float | None = Field(default=None, ge=0, le=1)  # extension
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)  # extension
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)  # extension
    # OpenAI's: part of the prefix cache's namespace for a request without a session id (serve/_tenants.py).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)

    # Fields OpenAI's clients send on their own, accepted while their value asks
    # for nothing this server does not do: null, or the value here (with how
    # the error says it).
    HARMLESS: ClassVar[dict[str, tuple[object, str]]] = {}

    @field_validator("*")
    @classmethod
    def _harmless(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls.HARMLESS.get(info.field_name or "")
        if allowed is not None and value is not None and value != allowed[0]:
            raise _unsupported(value, allowed[1])
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias maps token ids (as strings of digits) to biases, got the key {key!r:.40}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: a bias is in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if any(not 0 <= t < 1 << 31 for t in ids or ()):
            raise ValueError("stop_token_ids are token ids (integers >= 0)")
        return ids

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choices(self) -> int:
        return self.n or 1

    def top_logprobs_asked(self) -> int | None:
        """How many top tokens' logprobs each token reports (0: its own
        only), or None for no logprobs."""
        raise NotImplementedError

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generate, NoOpFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens differ: give one")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _names_once(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("two functions have one name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice asks for a call, but no tools are given")
        if isinstance(choice, ToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return choice

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        from ..llm.interface import TEMPLATE_CALL_ARGS

        reserved = sorted(TEMPLATE_CALL_ARGS.intersection(kwargs or {}))
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: arguments of the template's call, not its variables")
        return kwargs

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: ``chat_template_kwargs``, and
        ``reasoning_effort`` (which GPT-OSS's template reads; ``"none"`` also
        turns thinking off where a template reads ``enable_thinking``, as
        Qwen3's does, unless chat_template_kwargs sets it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
        return kwargs

    def tools_offered(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (none where tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def called(self) -> tuple[str | None, bool] | None:
        """Where tool_choice asks for a call ("required", or a function
        named): the function's name (None: any) and whether calls may be
        several; else None."""
        choice = self.tool_choice
        if self.tools_offered() is None or choice in (None, "auto"):
            return None
        name = choice.function.name if isinstance(choice, ToolChoice) else None
        return name, self.parallel_tool_calls is not False

    def limit(self) -> tuple[str, int | None]:
        """The completion length asked for, and the field that asked."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Generate):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    HARMLESS = {**_Generate.HARMLESS, "echo": (False, "echo=false"), "best_of": (1, "best_of=1"),
                "suffix": ("", "no suffix")}

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], str) and len(value) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        return value

    def the_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]

    def limit(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


# A session file's name, as the server checks it (documented in the schema;
# the registry's own check says what is wrong with another).
FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$"


class SaveRequest(_Strict):
    name: str = Field(json_schema_extra={"pattern": FILE_NAME_PATTERN})


class LoadRequest(_Strict):
    name: str = Field(json_schema_extra={"pattern": FILE_NAME_PATTERN})
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error's body (OpenAI's shape): serve/_errors.py."""

    error: ErrorDetail


class ForkRequest(_Strict):
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
