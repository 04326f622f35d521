"""One error root: every exception class Hadar defines is a HadarError, with an honest
``retriable``; bad user input is a UsageError (one line, exit code 2 in the CLI)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    ProducerClosed,
    TopicAuthorizationFailedError,
)

from shared.errors import HadarError, UsageError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared")


def _module_names() -> Iterator[str]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue  # runs a program when imported
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@pytest.fixture(scope="module")
def hadar_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of services/ or shared/ (nested ones too)."""
    for name in _module_names():
        importlib.import_module(name)
    found = {f"{c.__module__}.{c.__qualname__}": c for c in _subclasses(BaseException)
             if c.__module__.split(".")[0] in PACKAGES}
    assert len(found) >= 20, sorted(found)   # the walk really saw the tree
    return found


def test_every_hadar_exception_is_a_hadar_error(hadar_exceptions) -> None:
    outside = sorted(name for name, cls in hadar_exceptions.items() if not issubclass(cls, HadarError))
    assert outside == []


def test_invalid_plan_is_no_assertion_error(hadar_exceptions) -> None:
    invalid_plan = hadar_exceptions["services.scheduler.core.policy.InvalidPlan"]
    assert not issubclass(invalid_plan, AssertionError)   # survives python -O, not caught as a test failure


def test_bad_user_input_is_a_usage_error(hadar_exceptions) -> None:
    usage = {name.rsplit(".", 1)[-1] for name, cls in hadar_exceptions.items() if issubclass(cls, UsageError)}
    assert {"UnknownPolicy", "TraceError", "ClusterSpecError", "JobFileError", "ConfigError"} <= usage


def test_documented_stdlib_bases_are_kept() -> None:
    from shared.store import ObjectNotFound
    from shared.wire.events import InvalidEvent

    assert issubclass(InvalidEvent, ValueError)   # shared.wire.events: "InvalidEvent (a ValueError)"
    assert issubclass(ObjectNotFound, KeyError)   # the store contract: a missing key is a KeyError


def test_no_class_is_retriable_by_default(hadar_exceptions) -> None:
    retriable = sorted(name for name, cls in hadar_exceptions.items()
                       if issubclass(cls, HadarError) and cls.retriable)
    assert retriable == []   # BusError and InfraError decide per raise, never by class


def test_retriable_can_be_set_per_raise() -> None:
    from devinfra import InfraError

    assert not HadarError("x").retriable and HadarError("x", retriable=True).retriable
    assert InfraError("minio not ready after 30s", retriable=True).retriable
    assert not InfraError("go not found").retriable
    assert str(HadarError("one line")) == "one line"


@pytest.mark.parametrize("exc, retriable", [
    (TimeoutError(), True),
    (ConnectionRefusedError(111, "refused"), True),
    (OSError("Multiple exceptions: [Errno 111] Connect call failed"), True),
    (KafkaConnectionError("broker down"), True),
    (KafkaTimeoutError("batch expired"), True),
    (TopicAuthorizationFailedError(), False),
    (ProducerClosed(), False),
    (RuntimeError("a bug"), False),
])
def test_bus_errors_are_retriable_only_when_the_broker_may_come_back(exc, retriable) -> None:
    from shared.bus.base import BusError, bus_error

    err = bus_error("publish to hadar.jobs", exc)
    assert isinstance(err, BusError) and isinstance(err, HadarError)
    assert err.retriable is retriable
    assert str(err).startswith(f"publish to hadar.jobs: {type(exc).__name__}")
