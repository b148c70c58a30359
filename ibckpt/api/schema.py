"""From a pydantic model to a structural OpenAPI v3 schema that a v1.20 apiserver accepts.

pydantic writes JSON Schema 2020-12 with $refs and anyOf-with-null for optional fields; a CRD wants every
type written out in place (structural), OpenAPI 3.0 keywords, no CEL. Anything this module does not know how
to carry over is an error, so a new kind of field cannot slip into the CRD half-translated.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Keywords a structural schema may carry, in the order they are written (stable, readable YAML).
_ORDER = (
    "description",
    "type",
    "format",
    "required",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "properties",
    "additionalProperties",
    "items",
    "allOf",
    "oneOf",
    "anyOf",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields",
)
_DROPPED = {"title"}


class SchemaError(ValueError):
    pass


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions = raw.pop("$defs", {})
    return _convert(raw, definitions, where=model.__name__)


def _resolve(node: dict[str, Any], definitions: dict[str, Any], where: str) -> dict[str, Any]:
    """One schema with its $ref (or optional-anyOf) replaced by the target; sibling keywords win."""
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").rsplit("/", 1)[-1]
        return {**_resolve(definitions[name], definitions, where), **node}
    if "anyOf" in node and any(choice == {"type": "null"} for choice in node["anyOf"]):
        choices = [choice for choice in node.pop("anyOf") if choice != {"type": "null"}]
        if len(choices) != 1:
            raise SchemaError(f"{where}: a union of several types cannot be a structural schema")
        if node.get("default", ...) is None:
            del node["default"]  # None means "leave it out", never a value to default to
        return {**_resolve(choices[0], definitions, where), **node}
    return node


def _convert(node: dict[str, Any], definitions: dict[str, Any], where: str) -> dict[str, Any]:
    node = _resolve(node, definitions, where)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, definitions, f"{where}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, definitions, f"{where}[]")
        elif key == "additionalProperties":
            if value is False:
                continue  # the apiserver prunes unknown fields; a structural schema may not say false
            if value is True:
                raise SchemaError(f"{where}: free-form objects are not structural")
            out[key] = _convert(value, definitions, f"{where}.*")
        elif key in {"allOf", "oneOf", "anyOf"}:
            out[key] = [_check_shape_only(choice, where) for choice in value]
        elif key == "const":
            out["enum"] = [value]
        elif key in {"exclusiveMinimum", "exclusiveMaximum"}:
            # JSON Schema's number form; OpenAPI 3.0 has a flag beside minimum/maximum.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default":
            out[key] = _without_nulls(value)
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings wrap; kubectl explain re-wraps anyway
        elif key in _ORDER:
            out[key] = value
        else:
            raise SchemaError(f"{where}: no structural form for the keyword {key!r}")
    if out.get("type") == "object" and isinstance(out.get("default"), dict):
        out["default"] = _shortest_default(out)
    return {key: out[key] for key in _ORDER if key in out}


def _without_nulls(value: Any) -> Any:
    """A default as the apiserver takes it: a null field is an absent field."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _check_shape_only(choice: dict[str, Any], where: str) -> dict[str, Any]:
    """Inside allOf/oneOf/anyOf a structural schema may only constrain, never declare types."""
    allowed = {"required", "allOf", "oneOf", "anyOf", "not"}
    if not set(choice) <= allowed:
        raise SchemaError(
            f"{where}: a oneOf/allOf branch may only hold {sorted(allowed)}, got {sorted(choice)}"
        )
    return {
        key: [_check_shape_only(sub, where) for sub in value] if key in {"allOf", "oneOf", "anyOf"} else value
        for key, value in choice.items()
    }


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """What the apiserver's defaulting makes of `value` under `schema` (objects and arrays, recursively)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        result = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in result and "default" in sub:
                result[name] = sub["default"]
            if name in result:
                result[name] = apply_defaults(result[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = schema.get("properties", {})
            result.update({k: apply_defaults(v, extra) for k, v in result.items() if k not in known})
        return result
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _shortest_default(schema: dict[str, Any]) -> dict[str, Any]:
    """An object's default without the entries its properties' own defaults fill in anyway: `default: {}`
    rather than a copy of the nested defaults, which could drift from them."""
    full: dict[str, Any] = schema["default"]
    from_empty = apply_defaults({}, schema)
    trimmed = {name: value for name, value in full.items() if from_empty.get(name) != value}
    return trimmed if apply_defaults(trimmed, schema) == full else full
