"""The tiny Qwen3 of llm_models.py with the tool-calling and reasoning
markup of several families in its vocabulary (MARKUP: single tokens, the
special ones special, as in each family's own tokenizer) and a chat template
that renders tools in the Hermes / Qwen format (``<tools>`` in the system
turn, calls as ``<tool_call>`` JSON, results as ``<tool_response>``, as
Qwen2.5's and Qwen3's templates do), exported once: the tool-calling and
reasoning tests' model. Other families' templates (chat_templates.py) are
given to it with ``LLM(..., chat_template=...)``: one package serves them all."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from aoti_sessions.llm.exporting import _export
from llm_models import FAST, SEED, _atomic_dir, _config, _source_key, _train_tokenizer, cache_dir, cached_package

CONTEXT = 2048

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": \
{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}\
{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# Each family's markup, one token each: Qwen's (added, not special), Llama 3's, Mistral's and harmony's
# (special: decoding leaves them out unless a format keeps them).
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_MARKUP = ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                  "<|constrain|>", "<|return|>", "<|call|>"]


def tools_model_dir() -> Path:
    """The tiny random Qwen3 of hf_model_dir("qwen3"), its tokenizer with
    MARKUP and SPECIAL_MARKUP, TOOLS_TEMPLATE its chat template and a
    context of CONTEXT (room for the tools' text: the test tokenizer spends
    many tokens on it)."""
    def build(folder: Path) -> None:
        tokenizer = _train_tokenizer()
        tokenizer.add_tokens(MARKUP)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIAL_MARKUP]})
        tokenizer.chat_template = TOOLS_TEMPLATE
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
               (("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("pad_token_id", "<|endoftext|>"))}
        config = _config("qwen3", len(tokenizer), ids)
        config.max_position_embeddings = CONTEXT
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.generation_config = transformers.GenerationConfig(**ids)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    key = _source_key("qwen3-tools", TOOLS_TEMPLATE, json.dumps([MARKUP, SPECIAL_MARKUP]), str(CONTEXT))
    return _atomic_dir(cache_dir() / "hf" / f"tools-{key}" / "tiny-qwen3-tools", build)


def tools_package(device: str = "cpu", max_cache_len: int = CONTEXT) -> Path:
    def build(path: Path) -> None:
        _export.export(tools_model_dir(), path, device=device, max_cache_len=max_cache_len, inductor_configs=FAST)

    return cached_package(f"llm-qwen3-tools-{device}", ("qwen3-tools", device, str(max_cache_len), TOOLS_TEMPLATE,
                                                        json.dumps([MARKUP, SPECIAL_MARKUP])), build)
