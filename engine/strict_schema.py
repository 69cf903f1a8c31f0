"""The strict reading of a JSON schema that grammars constrain generation with: an object schema that lists
its properties allows no others unless it says so (an absent ``additionalProperties`` means false), in
every nested schema (properties, array items, anyOf/oneOf branches, $defs, ...). This is what xgrammar's
strict mode (its default, and so vLLM's and SGLang's default backend) does; plain JSON Schema would let
the model add keys, and a weak model then writes keys until it runs out of tokens. An object schema that
lists no properties at all is a free-form map (a ``dict`` argument) and stays open, as vLLM's llguidance
backend reads it.

``strict=True`` (OpenAI's ``strict`` flag on a tool or a response format) goes further, as OpenAI's
structured outputs do: every listed property is required, and an object may not ask for other keys.

An integer with no bounds is held to I-JSON's interoperable range, +-(2**53 - 1) (RFC 7493): what every
JSON parser reads exactly, and it keeps a weak model from writing digits until it runs out of tokens.

Values that are data, not schemas (``enum``, ``const``, ``default``, ``examples``), are left alone."""
from __future__ import annotations

# keywords whose value maps names to schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is a schema or a list of schemas
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf", "not", "if", "then",
               "else", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")


SAFE_INTEGER = 2 ** 53 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def strict_schema(schema: dict, strict: bool = False, where: str = "schema") -> dict:
    """A copy of ``schema`` under the strict reading; ValueError naming ``where`` for a ``strict`` schema
    whose object asks for keys it does not list (OpenAI refuses those too)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: must be a JSON schema object")
    return _walk(schema, strict, where, in_all_of=False)


def _walk(node, strict: bool, where: str, in_all_of: bool):
    if isinstance(node, list):
        return [_walk(n, strict, f"{where}[{i}]", in_all_of) for i, n in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _walk(sub, strict, f"{where}.{key}.{name}", False) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = _walk(value, strict, f"{where}.{key}", False)
        elif key == "allOf":
            out[key] = _walk(value, strict, f"{where}.allOf", True)
        else:
            out[key] = value
    types = out.get("type")
    integer = types == "integer" or (isinstance(types, list) and "integer" in types)
    if integer and not any(b in out for b in _BOUNDS):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    listed = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    # A branch of allOf is one part of an object the other branches add keys to: closing each branch
    # would make their conjunction unsatisfiable, so only the object as a whole could be closed.
    if not listed or in_all_of:
        return out
    extra = out.get("additionalProperties")
    if strict:
        if extra not in (None, False):
            raise ValueError(f"{where}.additionalProperties: must be false (or absent) when strict is true")
        out["additionalProperties"] = False
        out["required"] = list(out.get("properties") or {})
    elif "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
