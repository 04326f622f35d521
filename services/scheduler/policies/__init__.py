"""Policies by name. Each is a class whose instances have ``name`` and ``plan(snapshot)``.

Modules are imported on first use so that loading one policy never pays for another
(the Gavel baselines import scipy).
"""

from __future__ import annotations

import importlib
from typing import Any

from services.scheduler.policy import Policy
from shared.errors import UsageError

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "yarn-cs": ("services.scheduler.policies.yarn_cs", "YarnCS"),
    "tiresias": ("services.scheduler.policies.tiresias", "Tiresias"),
    "gavel": ("services.scheduler.policies.gavel", "Gavel"),
    "gavel-makespan": ("services.scheduler.policies.gavel", "GavelMakespan"),
    "hadar": ("services.scheduler.policies.hadar", "Hadar"),
    "hadare": ("services.scheduler.policies.hadare", "HadarE"),
}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


class UnknownPolicy(UsageError):
    """A policy name that is not registered; the message lists the valid ones."""


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy instance; ``options`` go to its constructor (thresholds, horizon...)."""
    try:
        module_name, class_name = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)
