"""MinioStore rides out an S3 outage (issue 13 item 6): a write is retried with back-off
across at least a minute of the server being away, then fails with a retriable error."""

from __future__ import annotations

import asyncio

import pytest

from devinfra.common import free_port
from shared.clock import FakeClock
from shared.store import MinioStore, StoreUnavailable
from shared.store.minio import OUTAGE_RETRY_S, retry_delays
from shared.store.settings import S3Settings


def test_the_default_retry_window_spans_more_than_a_minute():
    delays = retry_delays(OUTAGE_RETRY_S)
    assert sum(delays) >= 60
    assert sum(delays) <= OUTAGE_RETRY_S
    assert delays == sorted(delays) and delays[0] < 1 and max(delays) <= 5


def test_no_window_no_retry():
    assert retry_delays(0) == []


def _closed_store(clock: FakeClock, retry_for_s: float) -> MinioStore:
    settings = S3Settings(endpoint=f"http://127.0.0.1:{free_port()}", access_key="k", secret_key="s" * 8,
                          bucket="bucket")
    return MinioStore(settings, retry_for_s=retry_for_s, clock=clock)


def test_a_write_to_a_server_that_stays_away_is_retried_then_fails_retriably():
    clock = FakeClock()
    t0 = clock.time()
    store = _closed_store(clock, 8.0)
    with pytest.raises(StoreUnavailable) as caught:
        asyncio.run(store.put("checkpoints/j/0/n0/0.safetensors", b"x"))
    assert caught.value.retriable
    assert "put" in str(caught.value) and "checkpoints/j/0/n0/0.safetensors" in str(caught.value)
    assert clock.time() - t0 == pytest.approx(sum(retry_delays(8.0)))   # it did wait out the window
    assert sum(retry_delays(8.0)) > 4


def test_a_missing_object_is_not_an_outage():
    """ObjectNotFound is an answer, not an outage: no retry (checked against a real
    server in tests/contract/test_store.py); here only that the classification says so."""
    from minio.error import S3Error

    from shared.store.minio import outage
    assert not outage(S3Error(None, "NoSuchKey", "gone", "r", "i", None))
    assert outage(S3Error(None, "ServiceUnavailable", "busy", "r", "i", None))
    assert outage(ConnectionRefusedError())


def test_a_refusal_is_an_answer_raised_once_as_store_denied():
    """A policy's refusal (or a revoked login) is not retried: the same call is refused again."""
    from minio.error import S3Error

    from shared.store import StoreDenied
    clock = FakeClock()
    t0 = clock.time()
    store = _closed_store(clock, 8.0)
    calls = []

    class RefusingClient:
        def put_object(self, *args, **kwargs):
            calls.append(kwargs.get("tags"))
            raise S3Error(None, "AccessDenied", "Access Denied.", "r", "i", None)

    store._client = RefusingClient()  # type: ignore[assignment]
    with pytest.raises(StoreDenied) as caught:
        asyncio.run(store.put("models/j/0.safetensors", b"x", owner="alice"))
    assert caught.value.code == "AccessDenied" and not caught.value.retriable
    assert str(caught.value) == "put 'models/j/0.safetensors': refused by the store (AccessDenied)"
    assert len(calls) == 1 and dict(calls[0]) == {"owner": "alice"} and clock.time() == t0
