"""Which JSON Schema keywords constrained decoding enforces. xgrammar (0.2.9) compiles a schema into
a grammar, but some keywords it accepts and then does not hold the output to (it would produce
instances that break them); a schema using one is refused, with the keyword and where it is, rather
than silently loosened. Annotations (title, description, default, examples, ...) are fine."""

from __future__ import annotations

import json

# JSON Schema keywords that assert something xgrammar 0.2.9 does not enforce (it would accept
# instances that break them): a schema using one is refused rather than silently loosened
_UNENFORCED = {
    "not": "'not'",
    "if": "'if'/'then'/'else'", "then": "'if'/'then'/'else'", "else": "'if'/'then'/'else'",
    "contains": "'contains'", "minContains": "'minContains'", "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'", "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'", "$dynamicRef": "'$dynamicRef'", "$recursiveRef": "'$recursiveRef'",
}
# the string formats xgrammar 0.2.9 enforces (others would be accepted as any string)
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
                     "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
# where a schema holds further schemas: name -> one schema, a list of them, or a map of them
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
        "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema, where: str = "the schema", root=None) -> None:
    """Raise ValueError naming the first keyword of ``schema`` that the backend would not enforce."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"invalid JSON schema for structured outputs: {where} must be an object or a boolean.")
    for key in schema:
        if key in _UNENFORCED:
            raise ValueError(f"JSON schema keyword {_UNENFORCED[key]} (at {where}) is not supported "
                             f"by structured outputs.")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS and schema.get("type") in ("string", None):
        raise ValueError(f"JSON schema format {fmt!r} (at {where}) is not supported by structured outputs; "
                         f"supported formats: {', '.join(sorted(FORMATS))}.")
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise ValueError(f"JSON schema keyword 'multipleOf' (at {where}) is supported on integers only.")
    if schema.get("uniqueItems") is True:
        raise ValueError(f"JSON schema keyword 'uniqueItems' (at {where}) is not supported by structured outputs.")
    _check_combinations(schema, where)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"JSON schema keyword 'allOf' with more than one schema (at {where}) is not "
                         f"supported by structured outputs.")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root):
        raise ValueError(f"JSON schema keyword 'oneOf' (at {where}) is supported only when its schemas cannot "
                         f"match the same value (different types, or a required property with different "
                         f"const or enum values); 'anyOf' is supported.")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"JSON schema $ref {ref!r} (at {where}) is not supported: only references "
                         f"within the schema ('#/...') are.")
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
        if missing:
            raise ValueError(f"JSON schema requires {missing[0]!r} (at {where}) without describing it in "
                             f"'properties', which structured outputs do not support.")
    for key in _ONE:
        if isinstance(schema.get(key), (dict, bool)):
            check_json_schema(schema[key], f"{where}.{key}", root)
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                check_json_schema(sub, f"{where}.{key}[{i}]", root)
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_json_schema(sub, f"{where}.{key}.{name}", root)


# keywords that assert nothing (and where further schemas live): fine beside 'enum' / 'const'
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$id", "$schema", "$anchor", "discriminator", "$defs", "definitions"})
_IS_TYPE = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
}


def _check_combinations(schema: dict, where: str) -> None:
    """Keywords xgrammar drops when another is present: everything beside 'enum' / 'const' but their
    type, and minLength / maxLength beside 'format' or 'pattern'."""
    if "enum" in schema or "const" in schema:
        name = "const" if "const" in schema else "enum"
        values = [schema["const"]] if name == "const" else schema["enum"]
        declared = schema.get("type")
        declared = [declared] if isinstance(declared, str) else declared
        if isinstance(declared, list) and isinstance(values, list):
            for value in values:
                if not any(_IS_TYPE.get(t, lambda v: False)(value) for t in declared):
                    raise ValueError(f"JSON schema {name} value {value!r} (at {where}) is not of its declared type "
                                     f"{schema['type']!r}.")
        others = sorted(set(schema) - _ANNOTATIONS - {"enum", "const", "type"})
        if others:
            raise ValueError(f"JSON schema keyword {others[0]!r} beside {name!r} (at {where}) is not supported by "
                             f"structured outputs.")
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    shapes = [k for k in ("format", "pattern") if k in schema]
    if lengths and shapes:
        raise ValueError(f"JSON schema keyword {lengths[0]!r} beside {shapes[0]!r} (at {where}) is not supported by "
                         f"structured outputs.")


def _resolve(schema, root, depth: int = 0):
    """A local ``$ref`` ("#/$defs/x") followed to the schema it names (None if it cannot be)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 16:
        node = root
        for part in schema["$ref"].lstrip("#").strip("/").split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        schema, depth = node, depth + 1
    return schema if isinstance(schema, dict) else None


_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def _types(schema) -> set[str] | None:
    """The JSON types a schema admits, integer counted as number (None: not known, or any)."""
    if "const" in schema:
        return {_JSON_TYPES[type(schema["const"])]}
    if isinstance(schema.get("enum"), list):
        return {_JSON_TYPES[type(v)] for v in schema["enum"]}
    declared = schema.get("type")
    declared = [declared] if isinstance(declared, str) else declared
    if isinstance(declared, list):
        return {"number" if t == "integer" else t for t in declared}
    return None


def _values(schema, name: str) -> set | None:
    """The values a required property of an object schema may take, when they are listed."""
    if name not in (schema.get("required") or ()):
        return None
    prop = (schema.get("properties") or {}).get(name)
    if not isinstance(prop, dict):
        return None
    if "const" in prop:
        return {_json_key(prop["const"])}
    if isinstance(prop.get("enum"), list):
        return {_json_key(v) for v in prop["enum"]}
    return None


def _json_key(value) -> str:
    return json.dumps(value, sort_keys=True)


def _disjoint(branches: list, root) -> bool:
    """Whether no value can match two of ``branches`` (so that oneOf means anyOf): their types are
    disjoint, or they are objects sharing a required property whose listed values are disjoint."""
    resolved = [_resolve(b, root) for b in branches]
    if any(b is None for b in resolved):
        return False
    types = [_types(b) for b in resolved]
    if all(t is not None for t in types) and sum(len(t) for t in types) == len(set().union(*types)):
        return True
    names = set.intersection(*(set(b.get("required") or ()) for b in resolved)) if resolved else set()
    for name in names:
        values = [_values(b, name) for b in resolved]
        if all(v is not None for v in values) and sum(len(v) for v in values) == len(set().union(*values)):
            return True
    return False
