"""shared.runtime.logging: every way a process logs comes out as one JSON object per line, same keys."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import structlog

from shared.runtime.logging import STABLE_KEYS, capture_prints, configure_logging

LEVELS = {"debug", "info", "warning", "error", "critical"}


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of ``text`` as a JSON object with the stable keys; fails on any other line."""
    records = []
    for line in text.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert record.keys() >= STABLE_KEYS, line
        assert record["level"] in LEVELS, line
        assert isinstance(record["event"], str) and isinstance(record["logger"], str), line
        assert datetime.fromisoformat(record["timestamp"]).utcoffset() is not None, line
        assert "exc_info" not in record, line
        records.append(record)
    return records


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """A stream to configure logging into; the process-wide logging state is put back after."""
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    handlers = {name: lg.handlers[:] for name, lg in logging.root.manager.loggerDict.items()
                if isinstance(lg, logging.Logger)}
    config = structlog.get_config()
    context = structlog.contextvars.get_contextvars()
    hooks = (sys.excepthook, threading.excepthook, sys.unraisablehook)
    stdout = sys.stdout
    try:
        yield io.StringIO()
    finally:
        sys.stdout = stdout
        sys.excepthook, threading.excepthook, sys.unraisablehook = hooks
        logging.captureWarnings(False)
        structlog.configure(**config)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**context)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
        for name, saved in handlers.items():
            logging.getLogger(name).handlers[:] = saved


def test_structlog_stdlib_warnings_and_exceptions_are_json_with_stable_keys(log_stream: io.StringIO) -> None:
    configure_logging("scheduler", stream=log_stream)
    structlog.contextvars.bind_contextvars(job="j-1", round=3)
    structlog.get_logger(__name__).bind(node="n1").info("round.planned", placements=2, access_key="AKIA...")
    structlog.get_logger("shared.bus.kafka").warning("bus.retry", attempt=2)
    logging.getLogger("aiokafka.consumer.group_coordinator").info("Joined group %r (generation %s)", "g", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("lr is very large", UserWarning, stacklevel=1)
    try:
        _ = 1 / 0
    except ZeroDivisionError:
        structlog.get_logger(__name__).exception("round.failed")
        logging.getLogger("asyncio").exception("Task exception was never retrieved")

    records = json_lines(log_stream.getvalue())
    assert [r["logger"] for r in records] == [__name__, "shared.bus.kafka", "aiokafka.consumer.group_coordinator",
                                              "py.warnings", __name__, "asyncio"]
    assert all(r["service"] == "scheduler" and r["job"] == "j-1" and r["round"] == 3 for r in records)
    planned, retry, joined, warned, failed, task = records
    assert planned["event"] == "round.planned" and planned["node"] == "n1" and planned["placements"] == 2
    assert planned["access_key"] == "***"
    assert retry["level"] == "warning" and retry["attempt"] == 2
    assert joined == {**joined, "event": "Joined group 'g' (generation 1)", "level": "info"}
    assert warned["level"] == "warning" and "UserWarning: lr is very large" in warned["event"]
    assert not warned["event"].endswith("\n")
    for record in (failed, task):
        assert record["level"] == "error" and record["exception"].startswith("Traceback")
        assert "ZeroDivisionError: division by zero" in record["exception"]


def test_secrets_are_masked_on_the_stdlib_path_too(log_stream: io.StringIO) -> None:
    configure_logging("tracker", stream=log_stream)
    structlog.contextvars.bind_contextvars(s3_secret_key="hunter2")
    logging.getLogger("urllib3.connectionpool").warning("Retrying (%d attempts left)", 2)
    (record,) = json_lines(log_stream.getvalue())
    assert record["s3_secret_key"] == "***" and "hunter2" not in log_stream.getvalue()


def test_uncaught_and_unraisable_exceptions_are_one_json_line_each(log_stream: io.StringIO) -> None:
    configure_logging("agent", stream=log_stream)
    try:
        raise RuntimeError("main thread died")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())   # what the interpreter calls for an uncaught exception

    def fail() -> None:
        raise ValueError("worker thread died")

    thread = threading.Thread(target=fail, name="uploader")
    thread.start()
    thread.join()

    class Leaky:
        def __del__(self) -> None:
            raise OSError("close failed")

    Leaky()
    main, in_thread, unraisable = json_lines(log_stream.getvalue())
    assert main["level"] == "critical" and main["logger"] == "hadar.uncaught"
    assert "RuntimeError: main thread died" in main["exception"]
    assert in_thread["event"] == "uncaught exception in thread uploader"
    assert "ValueError: worker thread died" in in_thread["exception"]
    assert in_thread["service"] == "agent"   # threads do not share the main thread's context
    assert unraisable["logger"] == "hadar.unraisable" and "OSError: close failed" in unraisable["exception"]


def test_a_record_logging_cannot_format_still_gives_one_json_line(log_stream: io.StringIO) -> None:
    configure_logging("profiler", stream=log_stream)
    logging.getLogger("somelib").info("%s and %s", "only one argument")
    (record,) = json_lines(log_stream.getvalue())
    assert record["logger"] == "somelib" and record["level"] == "error"
    assert "not enough arguments" in record["exception"]


def test_non_propagating_console_loggers_are_adopted(log_stream: io.StringIO,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    quiet = logging.getLogger("hadar-test.own-console")   # as torch sets up torch.distributed
    quiet.propagate = False
    quiet.addHandler(logging.StreamHandler(sys.stderr))
    chatty = logging.getLogger("hadar-test.also-console")   # prints, and propagates to the root
    chatty.addHandler(logging.StreamHandler(sys.stderr))
    try:
        configure_logging("worker", stream=log_stream)
        configure_logging("worker", stream=log_stream)   # reconfiguring does not duplicate lines
        quiet.warning("store based barrier timed out")
        chatty.warning("printed once")
        logging.getLogger("aiokafka").warning("once")
    finally:
        quiet.handlers.clear()
        chatty.handlers.clear()
    assert [r["event"] for r in json_lines(log_stream.getvalue())] == [
        "store based barrier timed out", "printed once", "once"]
    assert capsys.readouterr().err == ""


def test_levels_below_the_configured_one_are_dropped_on_both_paths(log_stream: io.StringIO) -> None:
    configure_logging("scheduler", level="warning", stream=log_stream)
    structlog.get_logger(__name__).info("quiet")
    logging.getLogger("aiokafka").info("quiet too")
    structlog.get_logger(__name__).warning("loud")
    assert [r["event"] for r in json_lines(log_stream.getvalue())] == ["loud"]


def test_captured_prints_become_one_record_per_line(log_stream: io.StringIO) -> None:
    configure_logging("worker", stream=log_stream)
    capture_prints()
    print("Downloading digits\nready", flush=True)
    print("50%", end="")
    print(" done")
    print()
    assert [(r["logger"], r["event"]) for r in json_lines(log_stream.getvalue())] == [
        ("stdout", "Downloading digits"), ("stdout", "ready"), ("stdout", "50% done")]
