"""The one rule for a test whose real part (a server, the docker client) is missing: it
fails under ``CI=true``, where every real part must be there, and skips elsewhere."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["unavailable"]


def unavailable(reason: str) -> NoReturn:
    """Fail under CI (the real part is required there), skip elsewhere; ``reason`` says why."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)
