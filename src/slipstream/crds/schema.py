"""Pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema.

    pydantic model_json_schema(by_alias=True) --to_structural()--> openAPIV3Schema of the CRD

Kubernetes accepts only *structural* schemas: every node has a type, no ``$ref``, no
``anyOf`` carrying types, ``exclusiveMinimum`` as a boolean (OpenAPI 3.0), and no
``additionalProperties: false`` next to ``properties``. This module rewrites pydantic's
output into that form and keeps what the API server can use: types, descriptions, defaults,
enums, bounds, string lengths and our ``x-kubernetes-validations``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_KEPT_KEYS = ("description", "default", "enum", "minimum", "maximum", "minLength", "maxLength",
              "minItems", "maxItems", "pattern", "format", "x-kubernetes-validations")


def structural_schema(model: type[BaseModel], *, defaults: bool = True) -> dict[str, Any]:
    """The structural schema of ``model``; object defaults become ``{}`` (see _object_default).
    ``defaults=False`` drops every default (a status is written whole by the operator)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _convert(raw, raw.get("$defs", {}))
    return schema if defaults else _without_defaults(schema)


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$ref`` (keeping sibling keys, which pydantic uses for field-level extras) and
    unwrap ``Optional`` (``anyOf: [X, null]``): an optional field is simply not required."""
    while True:
        if "$ref" in node:
            target = defs[node["$ref"].split("/")[-1]]
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            node = {**target, **siblings, **_merged_validations(target, siblings)}
        elif "anyOf" in node:
            options = [option for option in node["anyOf"] if option.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"only Optional[X] unions are supported, got {node['anyOf']}")
            siblings = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**options[0], **siblings, **_merged_validations(options[0], siblings)}
        elif "allOf" in node and len(node["allOf"]) == 1:
            siblings = {k: v for k, v in node.items() if k != "allOf"}
            node = {**node["allOf"][0], **siblings}
        else:
            return node


def _merged_validations(inner: dict[str, Any], outer: dict[str, Any]) -> dict[str, Any]:
    """Rules on the model and rules on the field that uses it both apply."""
    key = "x-kubernetes-validations"
    if key in inner and key in outer:
        return {key: inner[key] + outer[key]}
    return {}


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    out: dict[str, Any] = {"type": node.get("type", "object")}
    for key in _KEPT_KEYS:
        if key in node:
            out[key] = node[key]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if out.get("default") is None:
        out.pop("default", None)  # None defaults mean "absent"; never write null
    if out["type"] == "object":
        _convert_object(node, out, defs)
    elif out["type"] == "array":
        out["items"] = _convert(node["items"], defs)
    return out


def _convert_object(node: dict[str, Any], out: dict[str, Any], defs: dict[str, Any]) -> None:
    properties = node.get("properties")
    if properties:
        out["properties"] = {name: _convert(sub, defs) for name, sub in properties.items()}
        required = node.get("required", [])
        if required:
            out["required"] = list(required)
        for name, sub in out["properties"].items():
            if name not in required:
                _object_default(sub)
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _convert(node["additionalProperties"], defs)
    else:
        out["x-kubernetes-preserve-unknown-fields"] = True


def _object_default(sub: dict[str, Any]) -> None:
    """An optional object field with no required members defaults to the object of its
    members' defaults: the stored spec states every value in force, and CEL rules on the
    object can rely on its members being present. (The API server checks a default against
    the object's rules without applying nested defaults first, so ``{}`` would not do.)
    Members are converted first, so nested objects already carry their own full default."""
    if sub.get("type") != "object" or "properties" not in sub:
        return
    if sub.get("required"):
        sub.pop("default", None)
    else:
        sub["default"] = {name: member["default"] for name, member in sub["properties"].items()
                          if "default" in member}
