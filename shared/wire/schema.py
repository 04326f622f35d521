"""JSON Schema (draft 2020-12) of Hadar's events, generated from the event classes.

``schema()`` walks every class in :data:`shared.wire.events.EVENT_TYPES` (and the nested
records it reaches): dataclass fields and their annotations (``str``, ``int``, ``float``,
``bool``, ``bytes``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, ``Literal[...]``,
nested records). Required = fields without a default. Ranges from the classes' ``_check``
that JSON Schema can say are in :data:`CONSTRAINTS` (hand-copied; the rest are prose in
docs/events.md). The schema describes the msgpack map as JSON would show it: ``bytes``
is a msgpack *bin* on the wire and a base64 string in JSON.

``python -m shared.wire.schema`` writes ``docs/events.schema.json`` and the generated
reference section of ``docs/events.md``; ``tests/unit/test_event_schema.py`` fails when
either differs from what the code generates. :mod:`tests.unit.json_schema_check` validates JSON
events against exactly the subset generated here (jsonschema is not a dependency).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from shared.wire.events import (
    DEADLETTER_RAW_LIMIT,
    EVENT_TYPES,
    MAX_LOG_TAIL,
    MAX_MODEL_BYTES,
    MAX_OPTIMIZER_SLOTS,
    Event,
)
from shared.wire.records import DIGEST_RE, JOB_ID_RE, MAX_CONFIG_CHARS, NODE_ID_RE, Record, to_wire
from shared.wire.topics import TOPIC_BY_NAME, TOPIC_OF_TYPE

__all__ = ["schema", "reference_markdown", "write", "CONSTRAINTS"]

SCHEMA_ID = "https://hadar.invalid/events.schema.json"
ENVELOPE_KEYS = ("id", "ts", "source")
_INT64 = {"minimum": -(2**63), "maximum": 2**64 - 1}

_JOB_ID = {"pattern": JOB_ID_RE.pattern}
_NODE_ID = {"pattern": NODE_ID_RE.pattern}
_NONNEG = {"minimum": 0}

# (class, field) -> JSON Schema keywords: the ranges each class's ``_check`` enforces that a
# schema can express. Cross-field rules are prose (docs/events.md "Rules the schema cannot say").
CONSTRAINTS: dict[tuple[str, str], dict[str, Any]] = {
    ("Event", "id"): {"minLength": 1, "maxLength": 64},
    ("Event", "ts"): _NONNEG,
    ("Event", "source"): {"maxLength": 128},
    ("Hyperparameters", "lr"): {"exclusiveMinimum": 0, "maximum": 10},
    ("Hyperparameters", "seed"): {"minimum": 0, "maximum": 2**32 - 1},
    ("JobSpec", "job_id"): _JOB_ID,
    ("JobSpec", "user"): {"minLength": 1, "maxLength": 64},
    ("JobSpec", "model"): {"minLength": 1, "maxLength": 64},
    ("JobSpec", "dataset"): {"minLength": 1, "maxLength": 64},
    ("JobSpec", "batch_size"): {"minimum": 1, "maximum": 65536},
    ("JobSpec", "workers"): {"minimum": 1, "maximum": 64},
    ("JobSpec", "iterations"): {"minimum": 1, "maximum": 10**12},
    ("JobSpec", "priority"): {"exclusiveMinimum": 0, "maximum": 1000},
    ("JobSpec", "deadline_s"): {"exclusiveMinimum": 0},
    ("CopyFinished", "metric_name"): {"maxLength": 32},
    ("CopyFinished", "log_tail"): {"maxLength": MAX_LOG_TAIL},
    ("UserCode", "digest"): {"pattern": DIGEST_RE.pattern},
    ("UserCode", "size"): {"minimum": 1, "maximum": 2**40},
    ("UserCode", "entrypoint"): {"maxLength": 256, "pattern": "\\.py$"},
    ("UserCode", "args"): {"maxItems": 64, "items": {"maxLength": 1024}},
    ("UserCode", "config"): {"maxLength": MAX_CONFIG_CHARS},
    ("UserCode", "data_digest"): {"pattern": "^$|" + DIGEST_RE.pattern},
    ("UserCode", "data_size"): {"minimum": 0, "maximum": 2**44},
    ("UserCode", "hint"): {"maxLength": 32},
    ("GpuInfo", "index"): {"minimum": 0, "maximum": 1023},
    ("GpuInfo", "type"): {"minLength": 1, "maxLength": 32},
    ("JobCancelled", "job_id"): _JOB_ID,
    ("NodeRegistered", "node_id"): _NODE_ID,
    ("NodeRegistered", "gpus"): {"minItems": 1},
    ("NodeHeartbeat", "node_id"): _NODE_ID,
    ("ThroughputEstimate", "job_id"): _JOB_ID,
    ("ThroughputEstimate", "workers"): {"minimum": 1, "maximum": 64},
    ("ThroughputEstimate", "rates"): {"additionalProperties": {"type": "number", "minimum": 0}},
    ("ThroughputEstimate", "model_bytes"): {"minimum": 0, "maximum": MAX_MODEL_BYTES},
    ("ThroughputEstimate", "optimizer_slots"): {"minimum": 0, "maximum": MAX_OPTIMIZER_SLOTS},
    ("RoundStarted", "round"): _NONNEG,
    ("RoundStarted", "policy_options"): {"maxLength": 4096, "pattern": "^\\{"},
    ("RoundStarted", "seed"): _NONNEG,
    ("RoundStarted", "round_s"): _NONNEG,
    ("RoundStarted", "heartbeat_s"): _NONNEG,
    ("Assignment", "node_id"): _NODE_ID,
    ("Assignment", "round"): _NONNEG,
    ("Assignment", "copy"): {"minimum": 0, "maximum": 1023},
    ("Assignment", "gpus"): {"minItems": 1},
    ("Assignment", "world_size"): {"minimum": 1, "maximum": 64},
    ("Assignment", "step_budget"): _NONNEG,
    ("Assignment", "copies"): {"minimum": 1, "maximum": 1024},
    ("Assignment", "fork_workers"): {"minimum": 0, "maximum": 65536},
    ("Progress", "job_id"): _JOB_ID,
    ("Progress", "round"): _NONNEG,
    ("Progress", "copy"): _NONNEG,
    ("Progress", "steps_round"): _NONNEG,
    ("Progress", "samples_per_s"): _NONNEG,
    ("Progress", "workers"): {"minimum": 1},
    ("CopyFinished", "job_id"): _JOB_ID,
    ("CopyFinished", "round"): _NONNEG,
    ("CopyFinished", "copy"): _NONNEG,
    ("CopyFinished", "steps_round"): _NONNEG,
    ("CopyFinished", "start_s"): {"minimum": 0, "maximum": 86_400},
    ("ModelConsolidated", "job_id"): _JOB_ID,
    ("ModelConsolidated", "total_steps"): _NONNEG,
    ("RoundAbandoned", "job_id"): _JOB_ID,
    ("RoundAbandoned", "round"): _NONNEG,
    ("RoundAbandoned", "reason"): {"maxLength": 1024},
    ("JobCompleted", "job_id"): _JOB_ID,
    ("JobCompleted", "jct_s"): _NONNEG,
    ("DeadLetter", "raw"): {"maxLength": 4 * -(-DEADLETTER_RAW_LIMIT // 3)},  # base64 of the byte limit
}



# ---------------------------------------------------------------- generation


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_schema(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer", **_INT64}
    if hint is float:
        return {"type": "number", "description": "finite (no NaN or infinity); an integer is accepted"}
    if hint is bytes:
        return {"type": "string", "contentEncoding": "base64",
                "description": "msgpack bin on the wire (use_bin_type=True); base64 in JSON"}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return {"anyOf": [_type_schema(inner[0], defs), {"type": "null"}]}
    if origin is tuple:
        return {"type": "array", "items": _type_schema(args[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if isinstance(hint, type) and issubclass(hint, Record):
        _record_def(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    raise TypeError(f"unsupported annotation {hint!r}")  # pragma: no cover


def _constraint(cls: type, name: str) -> dict[str, Any]:
    owner = "Event" if issubclass(cls, Event) and name in ENVELOPE_KEYS else cls.__name__
    return CONSTRAINTS.get((owner, name), {})


def _with_constraint(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    if not extra:
        return base
    if "anyOf" in base:  # X | None: the range applies to X
        return {"anyOf": [_with_constraint(base["anyOf"][0], extra), *base["anyOf"][1:]]}
    return {**base, **extra}


def _default(f: dataclasses.Field[Any]) -> tuple[bool, Any]:
    if f.default is not dataclasses.MISSING:
        return True, to_wire(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return True, to_wire(f.default_factory())
    return False, None


def _object(cls: type, names: list[str], defs: dict[str, Any], title: str) -> dict[str, Any]:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    props: dict[str, Any] = {}
    required = []
    for name in names:
        prop = _with_constraint(_type_schema(hints[name], defs), _constraint(cls, name))
        has_default, value = _default(fields[name])
        if has_default and name != "id":
            prop = {**prop, "default": value}
        elif not has_default:
            required.append(name)
        props[name] = prop
    out: dict[str, Any] = {"title": title, "type": "object", "properties": props, "required": required,
                           "additionalProperties": False}
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(cls.__name__ + "("):
        out["description"] = " ".join(doc.split())
    return out


def _record_def(cls: type, defs: dict[str, Any]) -> None:
    if cls.__name__ in defs:
        return
    defs[cls.__name__] = {}  # reserve (recursion guard)
    defs[cls.__name__] = _object(cls, [f.name for f in dataclasses.fields(cls)], defs, cls.__name__)


def schema() -> dict[str, Any]:
    """The whole contract: one envelope schema per event type, ``oneOf`` them."""
    defs: dict[str, Any] = {}
    one_of = []
    for etype, cls in EVENT_TYPES.items():
        body_names = [f.name for f in dataclasses.fields(cls) if f.name not in ENVELOPE_KEYS]
        body = _object(cls, body_names, defs, f"{etype} body")
        env = _object(cls, list(ENVELOPE_KEYS), defs, etype)
        env["properties"] = {
            "type": {"const": etype},
            "v": {"const": cls.VERSION, "description": "schema version; any other value is dead-lettered"},
            **env["properties"],
            "body": {"$ref": f"#/$defs/{etype}Body"},
        }
        env["properties"]["id"]["description"] = "any 1-64 characters; consumers drop repeats of an id"
        env["required"] = ["type", "v", "id", "ts", "source", "body"]
        env["x-topic"] = TOPIC_OF_TYPE[etype]
        env.pop("description", None)
        body.pop("title")
        body["title"] = f"{etype} body"
        defs[f"{etype}Body"] = body
        defs[etype] = env
        one_of.append({"$ref": f"#/$defs/{etype}"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "Hadar event",
        "description": "One Kafka record value: a msgpack map {type, v, id, ts, source, body}. "
                       "Generated by shared/wire/schema.py from shared/wire/events.py; do not edit. "
                       "See docs/events.md for the rules a schema cannot say.",
        "oneOf": one_of,
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=False) + "\n"


# ---------------------------------------------------------------- markdown reference

BEGIN = "<!-- BEGIN GENERATED by `python -m shared.wire.schema`: do not edit by hand -->"
END = "<!-- END GENERATED -->"


def _type_text(s: dict[str, Any]) -> str:
    if "$ref" in s:
        return f"[{s['$ref'].rsplit('/', 1)[1]}](#{s['$ref'].rsplit('/', 1)[1].lower()})"
    if "anyOf" in s:
        return f"{_type_text(s['anyOf'][0])} or null"
    if "enum" in s:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    t: Any = s.get("type")   # a JSON Schema type name, or absent
    if t == "array":
        return f"array of {_type_text(s['items'])}"
    if t == "object":
        return f"map str -> {_type_text(s['additionalProperties'])}"
    if t == "string" and s.get("contentEncoding") == "base64":
        return "bytes (msgpack bin)"
    return {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}.get(t, str(t))


def _limits_text(s: dict[str, Any]) -> str:
    if "anyOf" in s:
        s = s["anyOf"][0]
    parts = []
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo = s.get("exclusiveMinimum")
    if s.get("type") == "integer" and (lo, hi) == (_INT64["minimum"], _INT64["maximum"]):
        lo = hi = None
    elif s.get("type") == "integer" and hi == _INT64["maximum"]:
        hi = None
    if xlo is not None:
        parts.append(f"> {xlo}" + (f", <= {hi}" if hi is not None else ""))
    elif lo is not None and hi is not None:
        parts.append(f"{lo}..{hi}")
    elif lo is not None:
        parts.append(f">= {lo}")
    if "minLength" in s or "maxLength" in s:
        parts.append(f"{s.get('minLength', 0)}-{s['maxLength']} chars" if "maxLength" in s
                     else f">= {s['minLength']} chars")
    if "pattern" in s:
        parts.append(f"matches `{s['pattern']}`")
    if "minItems" in s:
        parts.append(f"at least {s['minItems']} item")
    extra = s.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("minimum", _INT64["minimum"]) != _INT64["minimum"]:
        parts.append(f"values >= {extra['minimum']}")
    return "; ".join(parts)


def _table(obj: dict[str, Any]) -> list[str]:
    lines = ["| field | type | required / default | constraints |", "|---|---|---|---|"]
    for name, s in obj["properties"].items():
        req = "required" if name in obj["required"] else f"default `{json.dumps(s.get('default'))}`"
        lines.append(f"| `{name}` | {_type_text(s)} | {req} | {_limits_text(s)} |")
    return lines


def _key_text(cls: type[Event]) -> str:
    names = {f.name for f in dataclasses.fields(cls)}
    if "job_id" in names:
        return "`body.job_id`"
    if hasattr(cls, "job_id"):
        return "`body.job.job_id`"
    if "node_id" in names:
        return "`body.node_id`"
    if cls.TYPE == "RoundStarted":
        return "`round-<body.round>`"
    return f"`{cls.TYPE}`"


def reference_markdown() -> str:
    s = schema()
    defs = s["$defs"]
    out = [BEGIN, ""]
    out += ["| type | v | topic | key (`key_for`) | written by | read by |", "|---|---|---|---|---|---|"]
    for etype, cls in EVENT_TYPES.items():
        topic = TOPIC_BY_NAME[TOPIC_OF_TYPE[etype]]
        writers = ", ".join(topic.writers)
        out.append(f"| [{etype}](#{etype.lower()}) | {cls.VERSION} | `{topic.name}` | {_key_text(cls)} | "
                   f"{writers} | {', '.join(topic.readers)} |")
    out += ["", "Writers and readers are principals, from the topic table (`shared/wire/topics.py`), "
            "which the Kafka ACLs of a secured deployment are made from: `cli` is every user's `hadar` "
            "command (and an outside producer submitting jobs), which reads every topic for its views "
            "and replay without joining a consumer group; a service reads a topic it follows or "
            "rebuilds its state from."]
    for etype in EVENT_TYPES:
        body = defs[f"{etype}Body"]
        out += ["", f"### {etype}", ""]
        if "description" in body:
            out += [body["description"], ""]
        out += _table(body)
    out += ["", "### Nested records", ""]
    records = [n for n in defs if n not in EVENT_TYPES and not n.endswith("Body")]
    for name in records:
        out += [f"#### {name}", ""]
        if "description" in defs[name]:
            out += [defs[name]["description"], ""]
        out += _table(defs[name]) + [""]
    out += [END]
    return "\n".join(out)


def _replace_section(text: str, section: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + section + text[end:]


def write(root: Path) -> None:
    (root / "docs" / "events.schema.json").write_text(schema_text(), encoding="utf-8")
    md = root / "docs" / "events.md"
    md.write_text(_replace_section(md.read_text(encoding="utf-8"), reference_markdown()), encoding="utf-8")


# ---------------------------------------------------------------- validation (the generated subset)


if __name__ == "__main__":  # pragma: no cover
    write(Path(__file__).resolve().parents[2])
    print("wrote docs/events.schema.json and the reference section of docs/events.md")
