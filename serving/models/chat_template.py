"""The ChatML chat template of the tiny test model: Qwen2.5-style, renders tools and tool calls.

Built by string concatenation with no layout whitespace. Transformers renders templates with
trim_blocks, which eats a newline written right after a block tag, so such newlines are `{{ nl }}`.
"""

CHATML_TOOLS_TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}{% if part.type == 'text' %}{{ part.text }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ nl }}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}"
    "{{ nl }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ text(messages[0].content) }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role in ('user', 'developer') or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ text(message.content) }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant"
    "{% if message.content %}{{ nl }}{{ text(message.content) }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '{{ nl }}<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ text(message.content) }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
