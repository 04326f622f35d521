"""Validate JSON events against the schema :mod:`shared.wire.schema` generates.

A small validator for exactly the keywords that schema uses (jsonschema is not a
dependency), and the step from a valid JSON event to the msgpack map the wire holds
(base64 strings of ``bytes`` fields back to bytes). ``root`` defaults to
:func:`shared.wire.schema.schema`.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from shared.wire.schema import schema

__all__ = ["validate", "json_to_wire"]


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    return root["$defs"][ref.rsplit("/", 1)[1]]


def _is_type(value: Any, t: str) -> bool:
    if t in ("integer", "number") and isinstance(value, bool):
        return False
    kinds: dict[str, type | tuple[type, ...]] = {
        "integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
        "object": dict, "null": type(None)}
    return isinstance(value, kinds[t])


def validate(instance: Any, sub: dict[str, Any] | None = None, root: dict[str, Any] | None = None,
             path: str = "$") -> list[str]:
    """Errors of ``instance`` (JSON values) against the generated schema; [] when valid.

    Covers the keywords :func:`schema` emits: $ref, oneOf, anyOf, const, enum, type,
    properties, required, additionalProperties, items, minItems, minimum, maximum,
    exclusiveMinimum, minLength, maxLength, pattern (Python ``re.search``)."""
    root = root or schema()
    sub = root if sub is None else sub
    if "$ref" in sub:
        return validate(instance, _resolve(sub["$ref"], root), root, path)
    if "oneOf" in sub:
        results = [(b, validate(instance, b, root, path)) for b in sub["oneOf"]]
        passing = [b for b, errs in results if not errs]
        if len(passing) == 1:
            return []
        for branch, errs in results:  # the branch the record's "type" names explains best
            const = _resolve(branch["$ref"], root)["properties"]["type"].get("const") if "$ref" in branch else None
            if isinstance(instance, dict) and const is not None and instance.get("type") == const:
                return errs
        return [f"{path}: matches {len(passing)} of oneOf, not 1 (unknown type?)"]
    if "anyOf" in sub:
        errs = [validate(instance, b, root, path) for b in sub["anyOf"]]
        return [] if any(not e for e in errs) else errs[0]
    errors: list[str] = []
    if "const" in sub and (instance != sub["const"] or type(instance) is not type(sub["const"])):
        return [f"{path}: must be {sub['const']!r}"]
    if "enum" in sub and instance not in sub["enum"]:
        return [f"{path}: must be one of {sub['enum']}"]
    t = sub.get("type")
    if t is not None and not _is_type(instance, t):
        return [f"{path}: expected {t}, got {type(instance).__name__}"]
    if isinstance(instance, (int, float)) and not isinstance(instance, bool):
        if "minimum" in sub and instance < sub["minimum"]:
            errors.append(f"{path}: must be >= {sub['minimum']}")
        if "maximum" in sub and instance > sub["maximum"]:
            errors.append(f"{path}: must be <= {sub['maximum']}")
        if "exclusiveMinimum" in sub and instance <= sub["exclusiveMinimum"]:
            errors.append(f"{path}: must be > {sub['exclusiveMinimum']}")
    if isinstance(instance, str):
        if "minLength" in sub and len(instance) < sub["minLength"]:
            errors.append(f"{path}: shorter than {sub['minLength']}")
        if "maxLength" in sub and len(instance) > sub["maxLength"]:
            errors.append(f"{path}: longer than {sub['maxLength']}")
        if "pattern" in sub and not re.search(sub["pattern"], instance):
            errors.append(f"{path}: does not match {sub['pattern']}")
        if sub.get("contentEncoding") == "base64":
            try:
                base64.b64decode(instance, validate=True)
            except ValueError:
                errors.append(f"{path}: not base64")
    if isinstance(instance, list):
        if "minItems" in sub and len(instance) < sub["minItems"]:
            errors.append(f"{path}: fewer than {sub['minItems']} items")
        if "items" in sub:
            for i, item in enumerate(instance):
                errors += validate(item, sub["items"], root, f"{path}[{i}]")
    if isinstance(instance, dict):
        props = sub.get("properties", {})
        errors += [f"{path}: missing {k!r}" for k in sub.get("required", ()) if k not in instance]
        extra = sub.get("additionalProperties", True)
        for k, v in instance.items():
            if k in props:
                errors += validate(v, props[k], root, f"{path}.{k}")
            elif extra is False:
                errors.append(f"{path}: unknown field {k!r}")
            elif isinstance(extra, dict):
                errors += validate(v, extra, root, f"{path}[{k!r}]")
    return errors


def json_to_wire(instance: Any, sub: dict[str, Any] | None = None, root: dict[str, Any] | None = None) -> Any:
    """A valid JSON event as the msgpack map would hold it: base64 strings of bytes fields
    become bytes. Call after :func:`validate` returned no errors."""
    root = root or schema()
    sub = root if sub is None else sub
    if "$ref" in sub:
        return json_to_wire(instance, _resolve(sub["$ref"], root), root)
    if "oneOf" in sub or "anyOf" in sub:
        for branch in sub.get("oneOf", sub.get("anyOf")):
            if not validate(instance, branch, root):
                return json_to_wire(instance, branch, root)
        return instance
    if sub.get("contentEncoding") == "base64" and isinstance(instance, str):
        return base64.b64decode(instance)
    if isinstance(instance, list) and "items" in sub:
        return [json_to_wire(v, sub["items"], root) for v in instance]
    if isinstance(instance, dict):
        props = sub.get("properties", {})
        extra = sub.get("additionalProperties")
        return {k: json_to_wire(v, props[k] if k in props else extra if isinstance(extra, dict) else {}, root)
                for k, v in instance.items()}
    return instance
