"""A Qwen3-style chat template for tests: like the tiny model's ChatML template, but assistant turns
before the last user message lose their `<think>…</think>` block (Qwen3 rewrites history this way), so a
fresh render of a conversation differs from the tokens the model saw.

Transformers renders with trim_blocks (a newline right after a block tag is eaten): such newlines are
written as `{{ nl }}`."""

QWEN3_STYLE_TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content or '' %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip(nl) %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ content }}"
    "{% for call in m.tool_calls or [] %}"
    "{% if content or not loop.first %}{{ nl }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
