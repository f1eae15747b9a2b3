"""The body of ``POST /v1/responses`` (OpenAI's Responses API), checked as
strictly as chat's (serve/_protocol.py: an unknown field, a wrong type or a
value out of range is a 400 naming the field), and turned into the chat
request the server already runs (serve/_responses.py).

Input: a string (one user message) or a list of items: messages (``role``
user, system, developer or assistant; ``content`` a string or
``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output``; each made into chat messages (consecutive calls
join one assistant message, as a chat template renders them). Tools in the
Responses' flat shape (``{"type": "function", "name", "parameters"}``),
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text,
json_object, json_schema: held to by the grammar engine, as chat's
``response_format``; a tool_choice that asks for a call leaves no text
for it to hold), ``max_output_tokens``, ``temperature``, ``top_p``,
``instructions`` (a system message ahead of the conversation, not carried
to a follow-up: OpenAI's rule), ``store``, ``metadata``,
``previous_response_id`` and ``stream``. Fields OpenAI's clients send that
ask for nothing here are accepted: ``user``, ``safety_identifier``,
``service_tier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``stream_options``, ``include`` empty, ``truncation`` "disabled",
``background`` false; ``reasoning``, ``conversation``, ``prompt``,
``top_logprobs`` and ``max_tool_calls`` only null.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from ._protocol import (FUNCTION_NAME_PATTERN, ChatRequest, JSONSchemaFormat, Message, ResponseFormat, _Strict,
                        _unsupported)

RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9]{1,64}$"


class ContentPart(_Strict):
    """Text in a message: ``input_text``, or ``output_text`` (an assistant
    message of an earlier response, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # (output_text: none are made here)
    logprobs: list[Any] | None = None


def _str_or_list(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


# A string or a list of parts: a list's error is about its parts, not that it is no string.
# (The tags are type names, which serve/_errors.py leaves out of a field's path.)
Content = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[ContentPart], Tag("list")]],
                    Discriminator(_str_or_list, custom_error_type="invalid_content",
                                  custom_error_message="a string or a list of input_text parts")]


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = Field(default=None, max_length=256)  # (an output message sent back)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: str
    id: str | None = Field(default=None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Content
    id: str | None = Field(default=None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


# Tags that serve/_errors.py leaves out of a field's path (not identifiers): input[0].content, not input[0].message.content.
InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")]],
                      Discriminator(lambda v: f"type={_item_kind(v)}", custom_error_type="invalid_item",
                                    custom_error_message="an input item is a message, function_call or "
                                                         "function_call_output")]


def chat_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages (OpenAI chat's JSON: serve/_protocol.py's
    Message): a call joins the assistant message before it, where there is one."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


Input = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[InputItem], Tag("list")]],
                  Discriminator(_str_or_list, custom_error_type="invalid_input",
                                custom_error_message="the input is a string or a list of items")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (a required call is always held to its parameters)

    def as_chat(self) -> dict[str, Any]:
        """Chat's nested shape (serve/_protocol.py's ToolDef)."""
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(JSONSchemaFormat):
    """``text``, ``json_object``, or ``json_schema`` with chat's json_schema
    fields (``name``, ``schema``, ...) beside ``type`` (the Responses' flat shape)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")  # type: ignore[assignment]

    @model_validator(mode="after")
    def _named_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("a json_schema format needs its name")
        if self.type != "json_schema" and (self.name is not None or self.schema_ is not None):
            raise ValueError("a name and a schema go with type json_schema only")
        return self

    def as_chat(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JSONSchemaFormat.model_validate(self.model_dump(by_alias=True, exclude={"type"}))
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (a hint: the model is not told)


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # (nothing here is obfuscated)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    store: bool | None = None  # (default: true, as OpenAI's)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID_PATTERN)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted, asking for nothing here (module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("the input is empty: give a string or at least one item")
        return value

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and any(len(k) > 64 for k in value):
            raise ValueError("a metadata key is at most 64 characters")
        return value

    @field_validator("include", "truncation", "background", "reasoning", "conversation", "prompt", "top_logprobs",
                     "max_tool_calls")
    @classmethod
    def _asks_nothing(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = {"include": ([], "an empty include"), "truncation": ("disabled", "truncation=disabled"),
                   "background": (False, "background=false")}.get(info.field_name or "", (None, "null"))
        if value is not None and value != allowed[0]:
            raise _unsupported(value, allowed[1])
        return value

    @property
    def stored(self) -> bool:
        return self.store is not False

    def new_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return chat_messages(self.input)

    def chat(self, conversation: list[dict[str, Any]]) -> ChatRequest:
        """The chat request that generates this response after
        ``conversation`` (chat messages: an earlier response's and this
        input's): the instructions first, this request's tools and sampling.
        Chat's checks hold (pydantic's ValidationError: two tools of one
        name, a tool_choice naming none of them; serve/_responses.py names
        the field as the Responses do)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        # A call asked for leaves no text for a format to hold (OpenAI takes both; chat's response_format refuses it).
        fmt = self.text.format if self.text is not None and choice in (None, "none", "auto") else None
        return ChatRequest.model_validate({
            "messages": [Message.model_validate(m) for m in [*messages, *conversation]],
            "tools": [t.as_chat() for t in self.tools] if self.tools else None, "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": fmt.as_chat() if fmt is not None else None,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "stream": self.stream})
