"""The grammar tool calls are generated under, checked token by token with llguidance over strata-tiny's
tokenizer: the strict reading of argument schemas (engine/strict_schema.py), tool_choice "auto" (free
text until the model opens a call, then only a valid call), parallel_tool_calls, and the other formats.
The HTTP and client side is tests/unit/test_tool_call_clients.py; "auto" is checked here because a
random model never opens a call by itself."""
import json

import pytest

from engine import Engine, SamplingParams
from engine.model.tool_calls import parse_tool_calls, tool_grammar
from engine.strict_schema import SAFE_INTEGER, strict_schema

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
OPEN_ARGS = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"], "additionalProperties": True}}}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=32)


class Run:
    """A matcher of ``grammar`` fed text; ``ok`` is False from the first token the grammar refused."""

    def __init__(self, engine, grammar) -> None:
        self.engine, self.ok = engine, True
        self.m = engine.grammar_tokenizer().matcher(SamplingParams(grammar=grammar))

    def feed(self, text: str) -> "Run":
        for t in self.engine.tokenizer.encode(text):
            if not self.ok or not bool(self.m.allowed()[t]):
                self.ok = False
                return self
            self.m.consume(t)
        return self

    def allows(self, text: str) -> bool:
        return bool(self.m.allowed()[self.engine.tokenizer.encode(text)[0]])

    @property
    def may_end(self) -> bool:
        return self.m.done or any(bool(self.m.allowed()[e]) for e in self.engine.eos_ids)


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_strict_reading_closes_every_object_that_lists_its_properties():
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}}
    schema = {"type": "object", "$defs": {"P": point},
              "properties": {"p": {"$ref": "#/$defs/P"}, "ps": {"type": "array", "items": point},
                             "u": {"anyOf": [point, {"type": "null"}]}, "o": {"oneOf": [point]},
                             "free": {"type": "object", "additionalProperties": True},
                             "typed": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
                             "d": {"type": "object", "default": {"properties": {}}, "enum": [{"properties": {}}]},
                             "mix": {"allOf": [point, {"properties": {"y": {"type": "integer"}}}]}}}
    s = strict_schema(schema)
    assert s["additionalProperties"] is False and schema.get("additionalProperties") is None   # a copy
    assert s["$defs"]["P"]["additionalProperties"] is False and s["properties"]["ps"]["items"]["additionalProperties"] is False
    assert s["properties"]["u"]["anyOf"][0]["additionalProperties"] is False
    assert s["properties"]["o"]["oneOf"][0]["additionalProperties"] is False
    assert s["properties"]["free"]["additionalProperties"] is True          # explicit: honoured
    assert s["properties"]["typed"]["additionalProperties"]["type"] == "integer"     # a schema: honoured
    assert s["properties"]["d"]["default"] == {"properties": {}} and s["properties"]["d"]["enum"] == [{"properties": {}}]
    # allOf branches add keys to one object: closing each would make them contradict
    assert all("additionalProperties" not in b for b in s["properties"]["mix"]["allOf"])
    # integers without bounds get I-JSON's; a bound the schema sets is kept
    assert s["$defs"]["P"]["properties"]["x"] == {"type": "integer", "minimum": 0}
    assert strict_schema({"type": ["integer", "null"]})["maximum"] == SAFE_INTEGER


def test_strict_true_requires_every_property_and_refuses_open_objects():
    s = strict_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                       "required": ["a"]}, strict=True)
    assert s["required"] == ["a", "b"] and s["additionalProperties"] is False
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters.properties.n.additionalProperties"):
        strict_schema({"type": "object", "properties": {"n": {"type": "object", "properties": {},
                                                              "additionalProperties": True}}},
                      strict=True, where="tools[0].function.parameters")
    with pytest.raises(ValueError, match="JSON schema object"):
        strict_schema(["not", "a", "schema"])


def test_auto_is_free_text_until_the_model_opens_a_call(engine):
    g = tool_grammar([ADD], "auto", "hermes", parallel=False)
    prose = Run(engine, g).feed("Sure, 2 + 3 is 5. <tool_ca")
    assert prose.ok and prose.allows("x")        # not the tag yet: still free text
    assert Run(engine, g).feed("Just text, no call.\nDone.").may_end
    opened = Run(engine, g).feed("Let me add. <tool_call>")
    assert opened.ok and not opened.allows("x") and opened.allows("\n")
    args = opened.feed('\n{"name": "add", "arguments": {"a": 2, "b": 3')
    assert args.ok and not args.allows(",") and args.allows("}")    # no key the schema does not list
    assert not Run(engine, g).feed('<tool_call>\n{"name": "add", "arguments": {"a": 2}}').ok   # b is required
    done = Run(engine, g).feed("Adding. " + call("add", {"a": 2, "b": 3}))
    assert done.ok and done.may_end and not done.allows("\n")     # the reply ends after the call
    assert not Run(engine, g).feed('<tool_call>\n{"name": "mul"').ok


def test_parallel_tool_calls_allows_more_calls_and_false_allows_one(engine):
    two = call("add", {"a": 1, "b": 2}) + "\n" + call("add", {"a": 3, "b": 4})
    for choice in ("required", "auto"):
        assert Run(engine, tool_grammar([ADD], choice, "hermes", parallel=True)).feed(two).may_end
        assert not Run(engine, tool_grammar([ADD], choice, "hermes", parallel=False)).feed(two).ok
    # a named function is called once, as vLLM reads it
    named = tool_grammar([ADD], {"type": "function", "function": {"name": "add"}}, "hermes", parallel=True)
    assert not Run(engine, named).feed(two).ok
    content, calls = parse_tool_calls(two, "hermes", [ADD])
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_explicit_additional_properties_true_lets_the_call_add_keys(engine):
    run = Run(engine, tool_grammar([OPEN_ARGS], "required", "hermes")).feed(
        '<tool_call>\n{"name": "tag", "arguments": {"k": 1, "extra": "x"}}\n</tool_call>')
    assert run.ok and run.may_end


def test_refs_into_the_arguments_own_defs_still_resolve(engine):
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "properties": {"to": {"$ref": "#/$defs/P"}}, "required": ["to"]}}}
    g = tool_grammar([tool], "required", "hermes")
    assert Run(engine, g).feed(call("move", {"to": {"x": 1}})).may_end
    assert not Run(engine, g).feed('<tool_call>\n{"name": "move", "arguments": {"to": {"x": 1, "y"').ok


@pytest.mark.parametrize("fmt,text", [
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
])
def test_other_formats_hold_calls_to_the_strict_schema(engine, fmt, text):
    for choice in ("required", "auto"):
        g = tool_grammar([ADD], choice, fmt, parallel=False)
        assert Run(engine, g).feed(text).may_end
        assert not Run(engine, g).feed(text.replace('"b": 2', '"b": 2, "c": 3')).ok
        assert parse_tool_calls(text, fmt, [ADD])[1][0].name == "add"
    assert Run(engine, tool_grammar([ADD], "auto", fmt)).feed("Plain words.").may_end
