"""The tiny Qwen3 of llm_models.py with a chat template that renders tools
in the Hermes / Qwen format (``<tools>`` in the system turn, calls as
``<tool_call>`` JSON, results as ``<tool_response>``, as Qwen2.5's and
Qwen3's templates do), exported once: the tool-calling tests' model."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from aoti_sessions.llm import _export
from llm_models import FAST, _atomic_dir, cache_dir, cached_package, hf_model_dir

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


def tools_model_dir() -> Path:
    """hf_model_dir("qwen3") with TOOLS_TEMPLATE as its chat template."""
    source = hf_model_dir("qwen3")

    def build(folder: Path) -> None:
        shutil.copytree(source, folder, dirs_exist_ok=True)
        (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
        # Room for the tools' text (the test tokenizer spends many tokens on it).
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    key = hashlib.sha256(f"{TOOLS_TEMPLATE}\0{source.parent.name}\0{CONTEXT}".encode()).hexdigest()[:20]
    return _atomic_dir(cache_dir() / "hf" / f"tools-{key}" / "tiny-qwen3-tools", build)


def tools_package(device: str = "cpu", max_cache_len: int = CONTEXT) -> Path:
    def build(path: Path) -> None:
        _export.export(tools_model_dir(), path, device=device, max_cache_len=max_cache_len, inductor_configs=FAST)

    return cached_package(f"llm-qwen3-tools-{device}", ("qwen3-tools", device, str(max_cache_len), TOOLS_TEMPLATE),
                          build)
