"""Policies by name. Each is a class whose instances have ``name`` and ``plan(request)``.

Modules are imported on first use so that loading one policy never pays for another
(the Gavel baselines import scipy).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from services.scheduler.core.policy import Policy
from shared.errors import UsageError

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "yarn-cs": ("services.scheduler.policies.yarn_cs", "YarnCS"),
    "tiresias": ("services.scheduler.policies.tiresias", "Tiresias"),
    "gavel": ("services.scheduler.policies.gavel.policy", "Gavel"),
    "gavel-makespan": ("services.scheduler.policies.gavel.policy", "GavelMakespan"),
    "gavel-throughput": ("services.scheduler.policies.gavel.policy", "GavelThroughput"),
    "gavel-throughput-sia": ("services.scheduler.policies.gavel.policy", "GavelThroughputSia"),
    "hadar": ("services.scheduler.policies.hadar.policy", "Hadar"),
    "hadare": ("services.scheduler.policies.hadare.policy", "HadarE"),
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


class UnknownPolicy(UsageError):
    """A policy name that is not registered; the message lists the valid ones."""


def import_all() -> None:
    """Import every registered policy's module, so that the state types each registers for
    snapshots (``shared.persistence.codec.snapshot_type``) are all known."""
    for module_name, _ in _REGISTRY.values():
        importlib.import_module(module_name)


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy instance; ``options`` go to its constructor (thresholds, horizon...)."""
    try:
        module_name, class_name = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    policy: Policy = cls(**options)
    return policy


@dataclass(frozen=True, kw_only=True)
class PolicyChoice:
    """A policy by name and the options it is built with: what every RoundStarted records.

    Options are JSON values (numbers, strings, booleans, lists of them), so the choice can
    be written into the event log and a recorded round re-derived without retyping flags.
    Construction checks that the policy exists and accepts the options (it builds one).
    ``options_json`` is canonical (sorted keys, no spaces): two choices are the same
    policy configuration exactly when their ``key`` is equal.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        options = {str(k): _json_value(k, v) for k, v in sorted(dict(self.options).items())}
        object.__setattr__(self, "options", MappingProxyType(options))
        try:
            self.build()
        except UnknownPolicy:
            raise
        except (TypeError, ValueError) as exc:
            raise UnknownPolicy(f"policy {self.name!r} does not accept options {self.options_json}: {exc}") from None

    @property
    def options_json(self) -> str:
        return json.dumps(dict(self.options), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.options_json)

    def build(self) -> Policy:
        return make_policy(self.name, **self.options)

    @classmethod
    def recorded(cls, name: str, options_json: str) -> PolicyChoice:
        """The choice a RoundStarted recorded (``options_json`` as written by ``options_json``)."""
        try:
            options = json.loads(options_json or "{}")
        except ValueError as exc:
            raise UnknownPolicy(f"recorded policy options are not JSON: {exc}") from None
        if not isinstance(options, dict):
            raise UnknownPolicy("recorded policy options must be a JSON object")
        return cls(name=name, options=options)

    def describe(self) -> str:
        return self.name if not self.options else f"{self.name} {self.options_json}"


def parse_policy_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line; VALUE is JSON when it parses (``8``, ``true``,
    ``[1, 2]``), else the plain string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UnknownPolicy(f"policy option {text!r}: expected KEY=VALUE")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def parse_scoped_policy_option(text: str) -> tuple[str, str, Any]:
    """``POLICY:KEY=VALUE`` (the benchmarks' ``--policy-option``) -> (policy, key, value)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise UnknownPolicy(f"policy option {text!r}: expected POLICY:KEY=VALUE")
    key, value = parse_policy_option(rest)
    return name.strip(), key, value


def _json_value(key: object, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_json_value(key, v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise UnknownPolicy(f"policy option {key!r}: {value} is not a finite number")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise UnknownPolicy(f"policy option {key!r}: {type(value).__name__} cannot be recorded "
                        "(use numbers, strings, booleans or lists of them)")
