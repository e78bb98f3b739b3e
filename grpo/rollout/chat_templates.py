"""Chat templates of our own that tool formats render with (`grpo.rollout.tool_formats`).

`QWEN3_TEMPLATE` renders what Qwen3's stock template renders (the tools' system turn, Hermes
`<tool_call>` blocks, tool messages as `<tool_response>` blocks of a user turn, the empty
think block a generation prompt gets with enable_thinking false) with one change that makes
it prefix-preserving, as TRL's training templates make it: an assistant turn after the last
user message always shows its think block, empty when it has none, where the stock template
shows an empty one only on the conversation's last message, so that the turn a model sampled
renders the same once the tool messages that answer it follow. Turns before the last user
message render as the stock template renders them (without their reasoning), so a prompt
renders to the very same text. A turn's reasoning is its `reasoning_content`, or what its
content holds between <think> and </think> (both present, as TRL's training template asks).
"""

QWEN3_TEMPLATE = """\
{%- set nl = '\\n' -%}
{%- macro tools_turn(system) -%}
<|im_start|>system{{ nl }}{% if system is not none %}{{ system }}{{ nl }}{{ nl }}{% endif -%}
# Tools{{ nl }}{{ nl }}You may call one or more functions to assist with the user query.{{ nl }}{{ nl -}}
You are provided with function signatures within <tools></tools> XML tags:{{ nl }}<tools>
{%- for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>{{ nl }}{{ nl -}}
For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:{{ nl }}<tool_call>{{ nl -}}
{"name": <function-name>, "arguments": <args-json-object>}{{ nl }}</tool_call><|im_end|>{{ nl }}
{%- endmacro -%}
{%- set first_system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
{{- tools_turn(first_system) -}}
{%- elif first_system is not none -%}
{{- '<|im_start|>system' ~ nl ~ first_system ~ '<|im_end|>' ~ nl -}}
{%- endif -%}
{#- The last user message that is a query (not tool responses sent as a user turn): -1 if none. -#}
{%- set query = namespace(index=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and m.content is string
      and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
{%- set query.index = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- set text = m.content if m.content is string else '' -%}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' ~ m.role ~ nl ~ text ~ '<|im_end|>' ~ nl -}}
{%- elif m.role == 'assistant' -%}
{%- set thought = namespace(text='') -%}
{%- if m.reasoning_content is string -%}
{%- set thought.text = m.reasoning_content -%}
{%- elif '<think>' in text and '</think>' in text -%}
{%- set thought.text = text.split('</think>')[0].rstrip(nl).split('<think>')[-1].lstrip(nl) -%}
{%- set text = text.split('</think>')[-1].lstrip(nl) -%}
{%- endif -%}
{{- '<|im_start|>assistant' ~ nl -}}
{%- if loop.index0 > query.index -%}
{{- '<think>' ~ nl ~ thought.text.strip(nl) ~ nl ~ '</think>' ~ nl ~ nl ~ text.lstrip(nl) -}}
{%- else -%}
{{- text -}}
{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function else call -%}
{%- if text or not loop.first %}{{ nl }}{% endif -%}
<tool_call>{{ nl }}{"name": "{{ fn.name }}", "arguments": \
{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}{{ nl }}</tool_call>
{%- endfor -%}
{{- '<|im_end|>' ~ nl -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif -%}
{{- nl ~ '<tool_response>' ~ nl ~ text ~ nl ~ '</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ nl }}{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant' ~ nl -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>' ~ nl ~ nl ~ '</think>' ~ nl ~ nl -}}
{%- endif -%}
{%- endif -%}
"""
