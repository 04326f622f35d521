"""Bounded retries: how long to wait before trying again, and when to stop trying.

Pure bookkeeping (the caller passes its monotonic clock). Each key -- a round to
consolidate, a job to complete -- gets at most ``max_attempts`` attempts; after the n-th
failure the next attempt waits ``min(max_s, base_s * 2**(n-1))``. So a key is given up
at most ``max_attempts`` attempts and ``sum(min(max_s, base_s * 2**k) for k < max_attempts - 1)``
seconds of waiting after its first failure.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Attempts"]


@dataclass(frozen=True, kw_only=True)
class _Failures:
    count: int
    retry_at: float


class Attempts:
    """Failures per key and when each may be tried again; see the module docstring."""

    def __init__(self, *, max_attempts: int, base_s: float, max_s: float) -> None:
        if max_attempts < 1 or not 0 < base_s <= max_s:
            raise ValueError(f"need max_attempts >= 1 and 0 < base_s <= max_s, got {max_attempts}, {base_s}, {max_s}")
        self.max_attempts = max_attempts
        self._base_s = base_s
        self._max_s = max_s
        self._failures: dict[Hashable, _Failures] = {}

    def __len__(self) -> int:
        return len(self._failures)

    def waiting(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` failed and its back-off has not run out yet."""
        failures = self._failures.get(key)
        return failures is not None and now < failures.retry_at

    def failed(self, key: Hashable, now: float) -> float | None:
        """Count a failed attempt. The seconds to wait before the next one, or None when
        that was the last attempt allowed (the key is then forgotten: give it up)."""
        count = self._failures[key].count + 1 if key in self._failures else 1
        if count >= self.max_attempts:
            self._failures.pop(key, None)
            return None
        delay = min(self._max_s, self._base_s * 2 ** (count - 1))
        self._failures[key] = _Failures(count=count, retry_at=now + delay)
        return delay

    def attempts(self, key: Hashable) -> int:
        """Failed attempts of ``key`` so far."""
        failures = self._failures.get(key)
        return failures.count if failures is not None else 0

    def succeeded(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Forget every key not in ``keys`` (work no longer due: decided, cancelled...)."""
        wanted = set(keys)
        for key in [k for k in self._failures if k not in wanted]:
            del self._failures[key]
