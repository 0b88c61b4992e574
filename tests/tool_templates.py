"""Chat templates with tools for the tiny family checkpoints (tests/model_families.py), written for
these tests in the shape each family's released checkpoints render a conversation with tools:

    qwen2    ChatML; the tools in the system turn inside <tools></tools>, calls as
             <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response> user turns
    llama    Llama 3.1's headers; "Environment: ipython", the tools and the JSON call format in the
             first user turn, calls as {"name", "parameters"}, results in `ipython` turns
    mistral  [AVAILABLE_TOOLS] before the last [INST], calls as [TOOL_CALLS][{...}], results as
             [TOOL_RESULTS]{"content", "call_id"}[/TOOL_RESULTS]; its markers are control tokens
    gemma3   the family's own template (engine/families.py), which takes no tools: Halfmoon
             tells the model in the pythonic format's preamble

`write_family(case, folder)` writes the checkpoint with a context long enough for tool prompts
(byte-level: a character is a token), the family's control tokens and its template.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.model_families import BY_NAME, build_checkpoint

QWEN = r"""{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA = r"""{{ bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- set ns = namespace(first=true) %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if tools and ns.first %}Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{% endif %}{% set ns.first = false %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": {{ call.function.name | tojson }}, "parameters": {{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>
{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = r"""{{ bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}, "id": {{ call.id | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": {{ message.tool_call_id | tojson }}}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"qwen2": QWEN, "llama": LLAMA, "mistral": MISTRAL, "gemma3": None}
FORMATS = {"qwen2": "hermes", "llama": "llama3_json", "mistral": "mistral", "gemma3": "pythonic"}
CONTROL = {"mistral": ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                       "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]}
CONTEXT = 4096


def write_family(name: str, folder: Path) -> None:
    """The family's tiny checkpoint with a tool-length context, control tokens and template."""
    case = BY_NAME[name]
    case = dataclasses.replace(case, kwargs={**case.kwargs, "max_position_embeddings": CONTEXT})
    build_checkpoint(case, folder)
    _add_control_tokens(folder, CONTROL.get(name, []))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if TEMPLATES[name] is not None:
        config["chat_template"] = TEMPLATES[name]
    config_file.write_text(json.dumps(config))


def _add_control_tokens(folder: Path, tokens: list[str]) -> None:
    """Turn the vocabulary's last padding entries into special added tokens spelled `tokens`."""
    if not tokens:
        return
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    top = max(by_id)
    for k, token in enumerate(tokens):
        i = top - k
        del vocab[by_id[i]]
        vocab[token] = i
        data["added_tokens"].append({"id": i, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(data))
