"""Agent client libraries, unmodified, against the real server (the tools
package, its Hermes template; in this process and in an engine process):
LangChain's ChatOpenAI (``bind_tools``: a call comes back as LangChain's
tool call; ``with_structured_output``: a Pydantic model) and litellm
(tools, tool_choice required). litellm reads its model price list from the
internet unless told not to: ``LITELLM_LOCAL_MODEL_COST_MAP``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # (before litellm is imported)

from aoti_sessions.llm import LLM, RemoteLLM  # noqa: E402
from aoti_sessions.serve import create_app  # noqa: E402
from serving import running  # noqa: E402
from test_tools import ADD, PARAMETERS, QUESTION, TOOLS  # noqa: E402
from tool_models import tools_package  # noqa: E402

KEY = "clients-key"
MODEL = "tiny-qwen3-tools"


@pytest.fixture(scope="module", params=["one-process", "engine-process"])
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    kind = LLM if request.param == "one-process" else RemoteLLM
    with kind(tools_package(), "cpu", threads=1, max_sessions=8) as llm, running(create_app(llm, api_key=KEY)) as url:
        yield url


class Sum(BaseModel):
    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


def test_langchain_tools_and_structured_output(server: str) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    with httpx.Client(timeout=60) as http:  # (closed here: ChatOpenAI leaves its own open)
        chat = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key=KEY,  # type: ignore[arg-type]
                          temperature=1.0, seed=0, max_tokens=200, max_retries=0, http_client=http)
        for choice in ("get_weather", "any"):
            reply = chat.bind_tools(TOOLS, tool_choice=choice).invoke("What is the weather in Paris?")
            assert isinstance(reply, AIMessage) and len(reply.tool_calls) >= 1, reply
            for call in reply.tool_calls:
                assert call["name"] == "get_weather" or choice == "any"
                jsonschema.validate(call["args"], PARAMETERS[call["name"]])
                assert call["id"] and call["id"].startswith("call_")
        summed = chat.with_structured_output(Sum).invoke("Add two numbers.")
        assert isinstance(summed, Sum) and 0 <= summed.a <= 99


def test_litellm_tools(server: str) -> None:
    import litellm

    # (Its client given, and closed here: litellm keeps the ones it makes.)
    with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        def complete(**options: Any) -> Any:
            return litellm.completion(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key=KEY, client=client,
                                      messages=QUESTION, tools=TOOLS, max_tokens=200, temperature=1.0,
                                      parallel_tool_calls=False, num_retries=0, **options)

        replies = [complete(tool_choice="required", seed=seed) for seed in range(2)]
        named = complete(tool_choice={"type": "function", "function": {"name": "add"}}, seed=0)
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", reply
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0].function.arguments), ADD["function"]["parameters"])
