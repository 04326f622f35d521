"""Bounded retries: back-off doubling to a cap, and an end after max_attempts attempts."""

from __future__ import annotations

import pytest

from services.tracker.attempts import Attempts


def test_the_back_off_doubles_up_to_its_cap_and_the_last_attempt_gives_up() -> None:
    attempts = Attempts(max_attempts=6, base_s=1.0, max_s=5.0)
    delays = [attempts.failed("r", now=0.0) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, None]
    assert len(attempts) == 0 and attempts.attempts("r") == 0   # given up: forgotten


def test_a_key_waits_for_its_back_off_and_success_forgets_it() -> None:
    attempts = Attempts(max_attempts=3, base_s=2.0, max_s=60.0)
    assert not attempts.waiting("r", now=0.0)
    attempts.failed("r", now=10.0)
    assert attempts.waiting("r", now=11.9) and not attempts.waiting("r", now=12.0)
    assert attempts.attempts("r") == 1
    attempts.succeeded("r")
    assert not attempts.waiting("r", now=10.0) and len(attempts) == 0


def test_one_attempt_allowed_gives_up_at_the_first_failure() -> None:
    assert Attempts(max_attempts=1, base_s=1.0, max_s=1.0).failed("r", now=0.0) is None


def test_keys_no_longer_due_are_forgotten() -> None:
    attempts = Attempts(max_attempts=5, base_s=1.0, max_s=1.0)
    for key in ("a", "b", "c"):
        attempts.failed(key, now=0.0)
    attempts.retain(["b"])
    assert len(attempts) == 1 and attempts.attempts("b") == 1


@pytest.mark.parametrize(("max_attempts", "base_s", "max_s"), [(0, 1.0, 1.0), (3, 0.0, 1.0), (3, 2.0, 1.0)])
def test_bad_bounds_are_refused(max_attempts: int, base_s: float, max_s: float) -> None:
    with pytest.raises(ValueError):
        Attempts(max_attempts=max_attempts, base_s=base_s, max_s=max_s)
