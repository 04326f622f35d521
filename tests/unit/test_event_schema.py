"""docs/events.md and docs/events.schema.json stay in step with the event classes.

* The committed schema and the generated reference section of events.md are exactly what
  ``shared.wire.schema`` generates now (regenerate: ``python -m shared.wire.schema``).
* Every ``json event`` example in events.md validates against the schema (with the small
  validator of ``shared.wire.schema``: jsonschema is not a dependency) and, packed with
  plain msgpack, decodes with ``shared.wire.events.decode``.
* The validator agrees with ``decode`` on the refusals outside producers meet most:
  a missing field, an unknown field, an out-of-range value, another version.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from shared.wire import schema as event_schema
from shared.wire.events import EVENT_TYPES, InvalidEvent, decode, topic_for
from shared.wire.records import Record
from shared.wire.schema import BEGIN, CONSTRAINTS, END, schema
from shared.wire.topics import (
    ALL_TOPICS,
    DEADLETTER,
    LEADERSHIP,
    PRINCIPALS,
    TOPIC_OF_TYPE,
    read_by,
)
from tests.unit.json_schema_check import json_to_wire, validate

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"
SCHEMA_FILE = ROOT / "docs" / "events.schema.json"
REGENERATE = "out of date: run `python -m shared.wire.schema` and commit docs/"


def examples() -> list[dict[str, Any]]:
    blocks = re.findall(r"^```json event\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)
    return [json.loads(b) for b in blocks]


def wire(doc: dict[str, Any]) -> bytes:
    return msgpack.packb(json_to_wire(doc), use_bin_type=True)


def test_committed_schema_is_generated_from_the_code() -> None:
    assert SCHEMA_FILE.read_text(encoding="utf-8") == event_schema.schema_text(), REGENERATE


def test_the_reference_section_of_events_md_is_generated_from_the_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(BEGIN):text.index(END) + len(END)]
    assert section == event_schema.reference_markdown(), REGENERATE


def test_every_event_type_has_an_example() -> None:
    assert {e["type"] for e in examples()} == set(EVENT_TYPES)


@pytest.mark.parametrize("doc", examples(), ids=lambda d: f"{d['type']}-{d['id'][:8]}")
def test_example_validates_and_decodes(doc: dict[str, Any]) -> None:
    assert validate(doc) == []
    event = decode(wire(doc))
    assert doc["type"] == event.TYPE and event.id == doc["id"]
    assert topic_for(event) == TOPIC_OF_TYPE[doc["type"]]


def _job_submitted() -> dict[str, Any]:
    return next(copy.deepcopy(e) for e in examples() if e["type"] == "JobSubmitted")


def _mutations() -> list[tuple[str, Any]]:
    def missing(d: dict) -> None:
        del d["body"]["job"]["iterations"]

    def unknown(d: dict) -> None:
        d["body"]["job"]["gpus"] = 2

    def out_of_range(d: dict) -> None:
        d["body"]["job"]["workers"] = 0

    def bad_id(d: dict) -> None:
        d["body"]["job"]["job_id"] = "Upper-Case"

    def version(d: dict) -> None:
        d["v"] = 2

    def envelope(d: dict) -> None:
        d["partition"] = 0

    def wrong_type(d: dict) -> None:
        d["body"]["submitted_at"] = "yesterday"

    def bad_enum(d: dict) -> None:
        d["body"]["job"]["hyper"] = {"optimizer": "lbfgs"}

    return [(f.__name__, f) for f in (missing, unknown, out_of_range, bad_id, version, envelope, wrong_type,
                                      bad_enum)]


@pytest.mark.parametrize("name,mutate", _mutations(), ids=[n for n, _ in _mutations()])
def test_schema_and_decode_refuse_the_same_records(name: str, mutate: Any) -> None:
    doc = _job_submitted()
    mutate(doc)
    assert validate(doc), name
    with pytest.raises(InvalidEvent):
        decode(msgpack.packb(doc, use_bin_type=True))


def test_a_missing_field_names_the_field() -> None:
    doc = _job_submitted()
    del doc["body"]["job"]["iterations"]
    assert any("'iterations'" in e for e in validate(doc))
    with pytest.raises(InvalidEvent, match=r"JobSubmitted.job: missing field 'iterations'"):
        decode(msgpack.packb(doc, use_bin_type=True))


def test_required_and_defaults_follow_the_dataclasses() -> None:
    defs = schema()["$defs"]
    for etype, cls in EVENT_TYPES.items():
        body = defs[f"{etype}Body"]
        fields = [f for f in dataclasses.fields(cls) if f.name not in ("id", "ts", "source")]
        assert list(body["properties"]) == [f.name for f in fields]
        assert body["required"] == [f.name for f in fields if f.default is dataclasses.MISSING
                                    and f.default_factory is dataclasses.MISSING]


def test_every_constraint_names_a_real_field() -> None:
    classes: dict[str, type] = {"Event": next(iter(EVENT_TYPES.values()))}
    defs = schema()["$defs"]
    for name in defs:
        cls = EVENT_TYPES.get(name.removesuffix("Body"))
        if cls is None:
            import shared.wire.queues as queues
            import shared.wire.records as records
            cls = getattr(records, name, None) or getattr(queues, name)
        assert issubclass(cls, Record)
        classes.setdefault(cls.__name__, cls)
    for owner, field in CONSTRAINTS:
        assert field in {f.name for f in dataclasses.fields(classes[owner])}, (owner, field)


def test_bytes_are_base64_in_json_and_bin_on_the_wire() -> None:
    letter = next(e for e in examples() if e["type"] == "DeadLetter")
    raw = decode(wire(letter)).raw  # type: ignore[attr-defined]
    assert isinstance(raw, bytes) and msgpack.unpackb(raw)["type"] == "JobSubmitted"
    prop = schema()["$defs"]["DeadLetterBody"]["properties"]["raw"]
    assert prop["contentEncoding"] == "base64" and prop["maxLength"] == 1368


def test_the_topic_table_names_exactly_the_topics_each_service_reads() -> None:
    from services.agent.daemon.service import TOPICS as AGENT
    from services.profiler.service import INPUT_TOPICS as PROFILER
    from services.profiler.service import RECOVERY_TOPICS as PROFILER_START
    from services.scheduler.live.inputs import RECOVERY_TOPICS as SCHEDULER
    from services.tracker.service import INPUT_TOPICS as TRACKER

    # the scheduler alone follows hadar.deadletter, to count bad records once (issue 17)
    # ... and a standby scheduler or tracker reads hadar.leadership to see whether the active one renews
    reads = {"scheduler": {*SCHEDULER, DEADLETTER, LEADERSHIP}, "agent": set(AGENT),
             "tracker": {*TRACKER, LEADERSHIP}, "profiler": {*PROFILER, *PROFILER_START},
             "cli": set(ALL_TOPICS), "admin": set()}
    assert {p: set(read_by(p)) for p in PRINCIPALS} == reads


def test_replay_shows_raw_as_base64_with_its_length() -> None:
    from services.cli.replay import describe

    letter = decode(wire(next(e for e in examples() if e["type"] == "DeadLetter")))
    line = describe(letter, show_progress=False)
    raw = letter.raw  # type: ignore[attr-defined]
    assert line is not None and f"raw {len(raw)} bytes base64:" in line
    assert line.endswith(f"base64:{next(e for e in examples() if e['type'] == 'DeadLetter')['body']['raw']})")
    assert "b'" not in line and 'b"' not in line


def test_the_producer_example_submits_a_decodable_job(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The "Submitting a job without Hadar" block, run against a stand-in confluent_kafka."""
    import sys
    import types

    from shared.wire.events import JobSubmitted, key_for

    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Submitting a job without Hadar"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    sent: list[tuple[str, str, bytes]] = []

    class Producer:
        def __init__(self, config: dict) -> None:
            self.config = config

        def produce(self, topic: str, *, key: str, value: bytes, on_delivery: Any) -> None:
            sent.append((topic, key, value))
            on_delivery(None, types.SimpleNamespace(partition=lambda: 0, offset=lambda: 17))

        def flush(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "confluent_kafka", types.SimpleNamespace(Producer=Producer))
    exec(compile(block, "docs/events.md", "exec"), {})
    [(topic, key, value)] = sent
    event = decode(value)
    assert isinstance(event, JobSubmitted)
    assert (topic, key) == (topic_for(event), key_for(event))
    assert f"{event.job_id}: hadar.jobs[0]@17" in capsys.readouterr().out
