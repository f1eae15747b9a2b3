"""Reply formats (aoti_sessions.llm.runtime._replies and the formats behind it):
each family's tool calls (hermes, llama3_json, mistral in both its forms,
GPT-OSS's harmony through openai-harmony) and reasoning (``<think>``, harmony's
analysis channel) read from a reply's text, whole and in random pieces
(the same pieces); and on one exported random-weight model given each
family's chat template (tool_models.py, chat_templates.py), the grammars
of ``tool_choice`` required / named in each format and structured output
after the reasoning: every reply that ends is valid calls or valid JSON."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import chat_templates as templates
from aoti_sessions.llm import LLM, Constraint, Reasoning, ReplyFormat, SamplingParams, ToolCall
from aoti_sessions.llm.runtime import _harmony as harmony_module
from aoti_sessions.llm.runtime._harmony import vocabulary_file
from aoti_sessions.llm.runtime._tool_formats import Llama3Json, Mistral
from test_tools import ADD, PARAMETERS, QUESTION, TOOLS
from tool_models import tools_package

templates.harmony_vocabulary()


def read(format: ReplyFormat, reply: str, prompt: str = "", tools: bool = True) -> tuple[str, str | None, list[Any]]:
    """The reply read whole; checked against 20 random splits of it, streamed."""
    whole = format.parse(reply, prompt, tools)
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 40))))
        stream = format.stream(prompt, tools)
        pieces: list[Any] = []
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            pieces += stream.push(reply[a:b])
        pieces += stream.finish()
        thoughts = [p.text for p in pieces if isinstance(p, Reasoning)]
        assert ("".join(p for p in pieces if isinstance(p, str)), "".join(thoughts) if thoughts else None,
                [p for p in pieces if isinstance(p, ToolCall)]) == (whole.content, whole.reasoning, whole.calls)
        assert stream.calls == len(whole.calls)
    return whole.content, whole.reasoning, whole.calls


WEATHER_CALL, ADD_CALL = ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("add", '{"a": 1, "b": 2}')


def test_llama3_json_calls() -> None:
    llama = ReplyFormat(templates.LLAMA3)
    assert llama.tools is not None and llama.tools.name == "llama3_json" and llama.reasoning is None
    assert read(llama, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                       '{"name": "add", "parameters": {"a": 1, "b": 2}} and then') == (" and then", None,
                                                                                        [WEATHER_CALL, ADD_CALL])
    assert read(llama, '\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}') == ("", None, [ADD_CALL])
    for text in ('{"a": 1} is JSON, not a call', 'Hello {"name": "add", "parameters": {}}',
                 '{"name": "add", "parameters": {"a": 1}', "<|python_tag|>print(1)"):
        assert read(llama, text) == (text, None, [])


def test_mistral_calls_in_both_forms() -> None:
    mistral = ReplyFormat(templates.MISTRAL)
    assert mistral.tools is not None and mistral.tools.name == "mistral"
    assert read(mistral, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
                         '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2} [TOOL_CALLS]bad name[ARGS]{} '
                         '[TOOL_CALLS]add[ARGS]nope [TOOL_C') == (
        "Sure.  [TOOL_CALLS]bad name[ARGS]{} [TOOL_CALLS]add[ARGS]nope [TOOL_C", None, [WEATHER_CALL, ADD_CALL])
    assert read(mistral, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                         '{"name": "add", "arguments": {"a": 1, "b": 2}}]') == ("", None, [WEATHER_CALL, ADD_CALL])
    assert read(mistral, '[TOOL_CALLS][{"name": "add"}, 3]') == ('[TOOL_CALLS][{"name": "add"}, 3]', None, [])
    # Its templates take back nine letters and digits as a call's id, and refuse others.
    assert all(len(i) == 9 and i.isalnum() for i in {Mistral().call_id() for _ in range(20)})


def test_harmony_channels() -> None:
    harmony = ReplyFormat(templates.HARMONY)
    assert harmony.tools is not None and harmony.tools.name == "harmony"
    assert harmony.reasoning is not None and harmony.reasoning.name == "harmony"
    call = ('<|channel|>analysis<|message|>Weather: ask 天气 🎉<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}')
    assert read(harmony, call) == ("", "Weather: ask 天气 🎉", [WEATHER_CALL])
    assert read(harmony, call, tools=False) == ('{"city": "Paris", "days": 3}', "Weather: ask 天气 🎉", [])
    assert read(harmony, "<|channel|>analysis<|message|>2 and 2<|end|><|start|>assistant<|channel|>final"
                         "<|message|>It is 4.") == ("It is 4.", "2 and 2", [])
    # Not harmony (a random model's text): what the parser refused, and the rest, is text as written.
    assert read(harmony, "<|channel|>analysis<|message|>hm<|end|>junk<|message|>x") == ("junk<|message|>x", "hm", [])
    assert read(harmony, "no channels at all") == ("no channels at all", None, [])


def test_think_reasoning_then_calls() -> None:
    qwen3 = ReplyFormat(templates.QWEN3)
    assert qwen3.tools is not None and qwen3.tools.name == "hermes"
    assert qwen3.reasoning is not None and qwen3.reasoning.name == "think"
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    # Calls are read after the reasoning, never in it; the blanks between the two are neither.
    assert read(qwen3, f"\n<think>\nmaybe {call}</think>\n\n{call} done") == (" done", f"\nmaybe {call}", [ADD_CALL])
    # A prompt that opened <think> (DeepSeek-R1's template): the reply starts inside it, to its end if unclosed.
    opened = "<|im_start|>assistant\n<think>\n"
    assert read(qwen3, "still thinking", opened) == ("", "still thinking", [])
    assert read(qwen3, "so </think>4", opened) == ("4", "so ", [])
    # One that ends closing it (enable_thinking=False): the reply is all answer.
    assert read(qwen3, "\n<think>x</think>4", "<think>\n\n</think>\n\n") == ("<think>x</think>4", None, [])
    assert read(qwen3, "4 <think>x</think>") == ("4 <think>x</think>", None, [])
    assert read(qwen3, "<think>never closed") == ("", "never closed", [])
    assert ReplyFormat(templates.QWEN3, reasoning_parser="none").parse("<think>x</think>y").content == \
        "<think>x</think>y"


def test_harmony_vocabulary_from_the_models_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-OSS's tokenizer holds harmony's vocabulary: o200k_base.tiktoken
    converted as transformers converts tiktoken files writes the very file
    back (its SHA-256 as harmony checks it; another vocabulary writes none),
    and with neither harmony's cache nor its folder variable, harmony loads
    harmony from the model's vocabulary alone, offline."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocabulary = TikTokenConverter(vocab_file=str(templates.o200k_file()), additional_special_tokens=[]) \
        .converted().get_vocab()
    written = vocabulary_file(vocabulary, tmp_path / "written")
    assert written is not None and written.read_bytes() == templates.o200k_file().read_bytes()
    swapped = {**vocabulary, "a": vocabulary["b"], "b": vocabulary["a"]}  # (the same size, another vocabulary)
    assert vocabulary_file(swapped, tmp_path / "other") is None and not (tmp_path / "other").exists()
    # Harmony loaded anew, without its cache or folder variable: from the vocabulary alone.
    monkeypatch.setattr(harmony_module, "_encoding", None)
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("AOTI_SESSIONS_CACHE", str(tmp_path / "cache"))
    loaded = harmony_module.encoding(lambda: vocabulary)
    assert loaded.decode([200005, 35644, 200008]) == "<|channel|>analysis<|message|>"
    assert (tmp_path / "cache" / "harmony" / "o200k_base.tiktoken").is_file()


def test_formats_by_name_and_their_refusals() -> None:
    assert isinstance(ReplyFormat("", tool_parser="llama3_json").tools, Llama3Json)
    assert ReplyFormat(templates.QWEN3, tool_parser="none").tools is None
    assert ReplyFormat(templates.R1, reasoning_parser="deepseek_r1").reasoning is not None
    with pytest.raises(ValueError, match="tool_parser: unknown format 'nope'; known: harmony, hermes"):
        ReplyFormat("", tool_parser="nope")
    with pytest.raises(ValueError, match="reasoning_parser: unknown format"):
        ReplyFormat("", reasoning_parser="nope")
    with pytest.raises(ValueError, match="harmony reads a reply's calls and reasoning together"):
        ReplyFormat(templates.HARMONY, reasoning_parser="think")


# -- the model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def package() -> Any:
    return tools_package()


@pytest.fixture(scope="module")
def llms(package: Any) -> Iterator[dict[str, LLM]]:
    """The one package, with each family's chat template."""
    names = {"llama3": templates.LLAMA3, "mistral": templates.MISTRAL, "mistral_list": templates.MISTRAL_LIST,
             "harmony": templates.HARMONY, "qwen3": templates.QWEN3, "r1": templates.R1}
    out = {name: LLM(package, "cpu", threads=1, max_sessions=16, chat_template=t) for name, t in names.items()}
    yield out
    for llm in out.values():
        llm.close()


def test_templates_render_calls_results_and_variables(llms: dict[str, LLM]) -> None:
    follow = [*QUESTION, {"role": "assistant", "content": None, "reasoning_content": "Paris, so weather.",
                          "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
                                          "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
              {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "3"}]
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}' in llms["llama3"].chat_prompt(follow, TOOLS).text
    assert '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}' in llms["mistral"].chat_prompt(follow, TOOLS).text
    harmony = llms["harmony"].chat_prompt(follow, TOOLS, {"reasoning_effort": "high"}).text
    assert "Reasoning: high" in harmony and "<|channel|>analysis<|message|>Paris, so weather.<|end|>" in harmony
    assert "<|constrain|>json<|message|>{\"a\": 1, \"b\": 2}<|call|>" in harmony
    assert "<think>\nParis, so weather.\n</think>" in llms["qwen3"].chat_prompt(follow, TOOLS).text
    assert llms["qwen3"].chat_prompt(QUESTION, template_kwargs={"enable_thinking": False}).text.endswith(
        "<think>\n\n</think>\n\n")
    assert not llms["qwen3"].chat_prompt(QUESTION).text.endswith("</think>\n\n")
    with pytest.raises(ValueError, match="template_kwargs: add_generation_prompt: the template's caller's own"):
        llms["qwen3"].chat_prompt(QUESTION, template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="refused the messages.*length 9"):  # (Mistral's own check of ids)
        llms["mistral"].chat_prompt([*follow[:1], {**follow[1], "tool_calls": [
            {**follow[1]["tool_calls"][0], "id": "call_0123456789"}]}], TOOLS)


def test_a_chat_template_is_checked_at_start_and_its_variables_when_given(package: Any) -> None:
    with pytest.raises(ValueError, match="chat_template: cannot render a user's message"):
        LLM(package, "cpu", threads=1, chat_template="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="tool_parser: unknown format"):
        LLM(package, "cpu", threads=1, tool_parser="hermes2")
    # A template's own errors on the variables a request gave it refuse the request (a 400), not the server.
    with LLM(package, "cpu", threads=1, chat_template="{{ messages[0].content + (suffix or '') }}") as llm:
        assert llm.chat_prompt(QUESTION, template_kwargs={"suffix": "!"}).text == QUESTION[0]["content"] + "!"
        with pytest.raises(ValueError, match="refused the messages: TypeError"):
            llm.chat_prompt(QUESTION, template_kwargs={"suffix": 5})


def calls_of(llm: LLM, text: str, prompt: str) -> tuple[list[ToolCall], str | None]:
    reply = llm.reply_format.parse(text, prompt)
    assert reply.calls and not reply.content.strip(), text
    for call in reply.calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    return reply.calls, reply.reasoning


@pytest.mark.parametrize("family", ["llama3", "mistral", "mistral_list", "harmony", "qwen3", "r1"])
def test_a_random_model_held_by_each_format_calls_validly(llms: dict[str, LLM], family: str) -> None:
    """tool_choice required (one or more) and named, in the family's format
    (after its reasoning, where it reasons): every reply that ends is calls
    of the offered tools with valid arguments, read back by its format. The
    markup's special tokens ([TOOL_CALLS], harmony's) stay in the text."""
    llm = llms[family]
    formats = llm.reply_format
    prompt = llm.chat_prompt(QUESTION, TOOLS)
    keep = formats.keep(True)
    ended = 0
    for seed in range(6):
        name = "add" if seed % 2 else None
        constraint = formats.after_reasoning(formats.tool_constraint(TOOLS, name, parallel=seed % 3 == 0),
                                             prompt.text, calls=True)
        with llm.new_session() as s:
            done = s.generate(prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=seed, constraint=constraint,
                                                     keep_special_tokens=keep))
        if done.finish_reason != "stop":  # (several calls, or reasoning never closed, may run out of tokens)
            assert seed % 3 == 0 or formats.reasoning is not None, done.text
            continue
        ended += 1
        calls, _ = calls_of(llm, done.text, prompt.text)
        assert name is None or {c.name for c in calls} == {name}
        assert seed % 3 == 0 or len(calls) == 1
    assert ended >= 2
    if family in ("mistral", "harmony"):  # its markup is special: a text that does not keep it has no calls
        with llm.new_session() as s:
            bare = s.generate(prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=1, constraint=constraint))
        assert not formats.parse(bare.text, prompt.text).calls


def test_structured_output_follows_the_reasoning(llms: dict[str, LLM]) -> None:
    """A json_schema held after the reasoning: the reply reasons, then its
    answer is valid JSON, not a thought (R1's template opens <think> in the
    prompt: without the reasoning first, the JSON would be read as
    reasoning); with thinking off (the prompt closed it), at once."""
    schema = ADD["function"]["parameters"]
    llm = llms["r1"]
    prompt = llm.chat_prompt(QUESTION)
    answered = 0
    for seed in range(8):
        held = llm.reply_format.after_reasoning(Constraint.json_schema(schema), prompt.text)
        with llm.new_session() as s:
            done = s.generate(prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=seed, constraint=held))
        reply = llm.reply_format.parse(done.text, prompt.text)
        assert reply.reasoning is not None, done.text
        if done.finish_reason == "stop":
            jsonschema.validate(json.loads(reply.content), schema)
            answered += 1
        else:
            assert not reply.content, done.text  # (still reasoning)
    assert answered >= 2
    qwen3 = llms["qwen3"]
    off = qwen3.chat_prompt(QUESTION, template_kwargs={"enable_thinking": False})
    held = qwen3.reply_format.after_reasoning(Constraint.json_schema(schema), off.text)
    with qwen3.new_session() as s:
        done = s.generate(off, SamplingParams(max_tokens=60, temperature=1.0, seed=0, constraint=held))
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(qwen3.reply_format.parse(done.text, off.text).content), schema)
