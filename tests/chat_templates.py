"""Chat templates of several families, cut down to what their tool calls and
reasoning look like (each renders tools, calls and their results the way
the family's own template does), for the tests' one model
(tool_models.py): ``LLM(package, chat_template=...)``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tool_models import TOOLS_TEMPLATE

# Llama 3.1 / 3.2 / 3.3: JSON calls {"name", "parameters"}, results as ipython turns.
LLAMA3 = """\
{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
You have access to the following functions. To call a function, respond with JSON for a function call: \
{"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral (v11 and later): [TOOL_CALLS]name[ARGS]{...}; call ids of nine letters and digits, or it refuses.
MISTRAL = """\
{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\
{% endif %}[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}</s>
{%- elif message.role == 'assistant' %}{{ message.content }}</s>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.tool_call_id }}[TOOL_CONTENT]{{ message.content }}\
[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""

# Mistral before v11: [TOOL_CALLS] and a JSON list of {"name", "arguments"}.
MISTRAL_LIST = MISTRAL.replace(
    "{%- for call in message.tool_calls %}",
    "[TOOL_CALLS][{%- for call in message.tool_calls %}").replace(
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}",
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    '{% if not loop.last %}, {% endif %}{% endfor %}]')

# GPT-OSS (harmony): channels, calls to=functions.NAME, reasoning_effort in the system message, the
# reasoning of an assistant message (reasoning_content, or thinking as GPT-OSS's template reads it) as analysis.
HARMONY = """\
<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}// {{ t.function.description | default('') }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set thought = message.reasoning_content or message.thinking %}
{%- if thought %}<|start|>assistant<|channel|>analysis<|message|>{{ thought }}<|end|>{% endif %}
{%- for call in message.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.\
{{ call.function.name }} <|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}
{%- if message.content %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>{% endif %}
{%- elif message.role == 'tool' %}<|start|>functions.{{ message.name | default('tool') }} to=assistant\
<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

# Qwen3: the Hermes template of tool_models.py, with <think> reasoning (reasoning_content rendered back) and
# enable_thinking.
_GENERATION = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
_CLOSED = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
_THINKING = TOOLS_TEMPLATE.replace(
    "<|im_start|>assistant\n{% if message.content %}",
    "<|im_start|>assistant\n{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}{% if message.content %}")
assert _THINKING != TOOLS_TEMPLATE and TOOLS_TEMPLATE.endswith(_GENERATION)
QWEN3 = _THINKING.replace(_GENERATION, "{%- if add_generation_prompt %}<|im_start|>assistant\n" + _CLOSED
                          + "{% endif %}{% endif %}")

# DeepSeek-R1 and the thinking-only models (Qwen3's Thinking-2507): the generation prompt opens <think>, so
# the reply starts inside it (here closed instead with enable_thinking=False, as Qwen3's is).
R1 = _THINKING.replace(_GENERATION, "{%- if add_generation_prompt %}<|im_start|>assistant\n" + _CLOSED
                       + "{% else %}<think>\n{% endif %}{% endif %}")

def o200k_file() -> Path:
    """An o200k_base.tiktoken on this machine: litellm (in the test extra)
    ships the very file (harmony checks its SHA-256), named by the SHA-1 of
    its URL, as harmony's cache folder names it."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None and spec.submodule_search_locations, "litellm (the test extra) is not installed"
    path = Path(list(spec.submodule_search_locations)[0]) / "litellm_core_utils" / "tokenizers" / \
        "fb374d419588a4632f3f557e76b4b70aebbca790"
    assert path.is_file(), f"no o200k_base.tiktoken at {path}"
    return path


def harmony_vocabulary() -> None:
    """Points openai-harmony's cache at o200k_file()'s folder (it would
    download the file on first use; tests have no internet)."""
    os.environ.setdefault("TIKTOKEN_RS_CACHE_DIR", str(o200k_file().parent))
