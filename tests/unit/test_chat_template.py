"""Chat templates render as transformers renders them (transformers' apply_chat_template is the oracle):
system/developer messages, content as text parts, tools, assistant tool calls, tool results,
add_generation_prompt, special tokens, loop controls and raise_exception; tool calls parse back."""
import json

import pytest

from engine.model.chat import render_chat
from engine.model.tokenizer import CHAT_TEMPLATE
from engine.model.tool_calls import ToolCallStreamer, parse_tool_calls, tool_call_format, tools_system_prompt

# Written for these tests in the shapes checkpoints ship (ChatML with tools; a header-style one with a BOS).
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}Tools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' and loop.first %}{% continue %}{% endif %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
HEADER_BOS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'developer', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "<|header|>{{ m['role'] }}<|/header|>\n\n{{ m['content'] | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header|>assistant<|/header|>\n\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "  héllo ✓ "}],
    [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "weather in Oslo?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}],
]


def _oracle(template, messages, tools, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    from engine.model.tokenizer import build_byte_tokenizer
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=build_byte_tokenizer(), bos_token="<|start|>",
                                               eos_token="<|endoftext|>")
    tok.chat_template = template
    from engine.model.chat import normalize_messages   # transformers takes text content and dict arguments
    return tok.apply_chat_template(normalize_messages(messages), tools=tools, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML_TOOLS, HEADER_BOS], ids=["strata-tiny", "chatml", "header"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_chat_matches_transformers(template, conv, gen):
    messages = CONVERSATIONS[conv]
    tools = TOOLS if template is CHATML_TOOLS else None
    special = {"bos_token": "<|start|>", "eos_token": "<|endoftext|>"}
    if template is HEADER_BOS and any(m["role"] == "tool" for m in messages):
        with pytest.raises(ValueError, match="messages: unsupported role tool"):
            render_chat(template, messages, add_generation_prompt=gen, special=special)
        return
    got = render_chat(template, messages, tools=tools, add_generation_prompt=gen, special=special)
    assert got == _oracle(template, messages, tools, gen)


def test_non_text_parts_and_broken_templates_are_value_errors():
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]"):
        render_chat(CHAT_TEMPLATE, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="chat_template"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])


def test_tool_calls_parse_back_and_stream_without_leaking_the_marker():
    assert tool_call_format(CHATML_TOOLS) == "hermes" and tool_call_format("[TOOL_CALLS]") == "mistral"
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes", TOOLS)
    assert content == "Let me check." and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert parse_tool_calls(unknown, "hermes", TOOLS) == (unknown, [])
    for step in (1, 2, 5):
        s = ToolCallStreamer("hermes", TOOLS)
        outs = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.finish()]
        streamed = "".join(c for c, _ in outs)
        deltas = [d for _, ds in outs for d in ds]
        assert "<tool" not in streamed and streamed.strip() == "Let me check."
        head, args = deltas[0], deltas[1:]    # OpenAI's shape: the head, then the arguments in fragments
        assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"] and head["index"] == 0
        assert all(d["index"] == 0 and set(d) == {"index", "function"} for d in args)
        assert json.loads("".join(d["function"]["arguments"] for d in args)) == {"city": "Oslo"}
    assert "get_weather" in tools_system_prompt(TOOLS, "hermes")
    c, calls = parse_tool_calls('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "mistral", TOOLS)
    assert c == "" and calls[0].arguments == '{"city": "Rome"}'
    c, calls = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json", TOOLS)
    assert calls[0].name == "get_weather"
