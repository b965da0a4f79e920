"""The Qwen3-Coder-style chat template of the bundled tokenizers (the tests' fixture tokenizer and the demo model):
system turn with a `<tools>` section, XML tool calls (`<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n...`),
`<tool_response>` turns, `<think>` reasoning and the `enable_thinking` switch."""

# The special tokens the template uses, in the id order of the bundled tokenizers (appended after the BPE vocab).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

QWEN3_CODER_TEMPLATE = r"""{%- macro render_value(v) -%}
{%- if v is string -%}{{ v }}{%- else -%}{{ v | tojson }}{%- endif -%}
{%- endmacro -%}
{%- if messages[0].role == "system" %}
{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = none %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message is not none or tools %}
{{- "<|im_start|>system\n" }}
{%- if system_message is not none %}
{{- system_message }}
{%- else %}
{{- "You are a helpful assistant." }}
{%- endif %}
{%- if tools %}
{{- "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- "\n<function>\n<name>" ~ fn.name ~ "</name>" }}
{%- if fn.description is defined %}
{{- "\n<description>" ~ fn.description | trim ~ "</description>" }}
{%- endif %}
{{- "\n<parameters>" }}
{%- if fn.parameters is defined and fn.parameters.properties is defined %}
{%- for pname, pschema in fn.parameters.properties | dictsort %}
{{- "\n<parameter>\n<name>" ~ pname ~ "</name>" }}
{%- if pschema.type is defined %}
{{- "\n<type>" ~ render_value(pschema.type) ~ "</type>" }}
{%- endif %}
{%- if pschema.description is defined %}
{{- "\n<description>" ~ pschema.description | trim ~ "</description>" }}
{%- endif %}
{%- if pschema.enum is defined %}
{{- "\n<enum>" ~ pschema.enum | tojson ~ "</enum>" }}
{%- endif %}
{{- "\n</parameter>" }}
{%- endfor %}
{%- endif %}
{%- if fn.parameters is defined and fn.parameters.required is defined %}
{{- "\n<required>" ~ fn.parameters.required | tojson ~ "</required>" }}
{%- endif %}
{{- "\n</parameters>\n</function>" }}
{%- endfor %}
{{- "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>" }}
{%- endif %}
{{- "<|im_end|>\n" }}
{%- endif %}
{%- set ns = namespace(last_query_index=loop_messages | length - 1) %}
{%- for message in loop_messages[::-1] %}
{%- set index = (loop_messages | length - 1) - loop.index0 %}
{%- if message.role == "user" and message.content is string and not message.content.startswith("<tool_response>") %}
{%- set ns.last_query_index = index %}
{%- break %}
{%- endif %}
{%- endfor %}
{%- for message in loop_messages %}
{%- set content = message.content if message.content is string else "" %}
{%- if message.role == "system" %}
{{- raise_exception("System message must be the first message.") }}
{%- elif message.role == "user" %}
{{- "<|im_start|>user\n" ~ content ~ "<|im_end|>\n" }}
{%- elif message.role == "assistant" %}
{%- set reasoning = "" %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif "</think>" in content %}
{%- set reasoning = content.split("</think>")[0].split("<think>")[-1] %}
{%- set content = content.split("</think>")[-1] %}
{%- endif %}
{{- "<|im_start|>assistant\n" }}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- "<think>\n" ~ reasoning.strip("\n") ~ "\n</think>\n\n" }}
{%- endif %}
{{- content.lstrip("\n") }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if loop.first and content | trim %}
{{- "\n\n" }}
{%- elif not loop.first %}
{{- "\n" }}
{%- endif %}
{{- "<tool_call>\n<function=" ~ call.name ~ ">\n" }}
{%- if call.arguments is mapping %}
{%- for arg_name, arg_value in call.arguments.items() %}
{{- "<parameter=" ~ arg_name ~ ">\n" ~ render_value(arg_value) ~ "\n</parameter>\n" }}
{%- endfor %}
{%- elif call.arguments is defined %}
{{- raise_exception("tool_call arguments must be a dict, got: " ~ call.arguments | string) }}
{%- endif %}
{{- "</function>\n</tool_call>" }}
{%- endfor %}
{%- endif %}
{{- "<|im_end|>\n" }}
{%- elif message.role == "tool" %}
{%- if loop.first or loop.previtem.role != "tool" %}
{{- "<|im_start|>user" }}
{%- endif %}
{{- "\n<tool_response>\n" ~ render_value(message.content) ~ "\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}
{{- "<|im_end|>\n" }}
{%- endif %}
{%- else %}
{{- raise_exception("Unknown message role: " ~ message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- "<|im_start|>assistant\n" }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- "<think>\n\n</think>\n\n" }}
{%- endif %}
{%- endif %}
"""


def tokenizer_config(token_to_id, model_max_length: int) -> dict:
    """Qwen3-style tokenizer_config.json contents for a tokenizer holding SPECIAL_TOKENS (`token_to_id`: its
    `tokenizers.Tokenizer.token_to_id`), with the Qwen3-Coder chat template."""
    decoder = {
        str(token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": QWEN3_CODER_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
