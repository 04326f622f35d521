"""Create or change Kafka SCRAM users through the AlterUserScramCredentials API.

aiokafka has no call for it, so this module adds the request (API 43, v0, flexible
encoding) and sends it with an admin client's connection. The client computes the salted
password (RFC 5802 ``Hi()``: PBKDF2-HMAC with the mechanism's hash) so the password itself
never travels; the broker derives the stored and server keys.

Guarantees: :func:`upsert_users` is idempotent (an upsert replaces the credential: this is
how a password is rotated) and raises :class:`~shared.bus.base.BusError` naming the first
user the broker refused. :func:`delete_users` removes users' credentials (a user without one
is fine): nobody can log in as them from then on. Salts come from ``random_bytes`` (passed
in).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping
from typing import TypeAlias

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from shared.bus.base import BusError

__all__ = ["upsert_users", "delete_users", "salted_password", "MECHANISM_CODES", "ITERATIONS"]

MECHANISM_CODES = {"SCRAM-SHA-256": 1, "SCRAM-SHA-512": 2}
_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
ITERATIONS = 4096
RESOURCE_NOT_FOUND = 91   # Kafka's error code: deleting a credential the user does not have


class AlterUserScramCredentialsResponse_v0(Response):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("results", CompactArray(("user", CompactString("utf-8")), ("error_code", Int16),
                                 ("error_message", CompactString("utf-8")), ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


class AlterUserScramCredentialsRequest_v0(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = AlterUserScramCredentialsResponse_v0
    SCHEMA = Schema(
        ("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8),
                                   ("tags", TaggedFields))),
        ("upsertions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8),
                                    ("iterations", Int32), ("salt", CompactBytes),
                                    ("salted_password", CompactBytes), ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


_Struct: TypeAlias = AlterUserScramCredentialsRequest_v0


class AlterUserScramCredentials(Request[_Struct]):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    API_KEY = 51

    def __init__(self, upsertions: list[tuple[str, int, int, bytes, bytes]],
                 deletions: list[tuple[str, int]] | None = None) -> None:
        self._upsertions = upsertions
        self._deletions = deletions or []

    def build(self, request_struct_class: type[_Struct]) -> _Struct:
        return request_struct_class([(*d, {}) for d in self._deletions], [(*u, {}) for u in self._upsertions], {})


def salted_password(mechanism: str, password: str, salt: bytes, iterations: int = ITERATIONS) -> bytes:
    """RFC 5802 ``Hi(password, salt, iterations)`` for ``mechanism``."""
    return hashlib.pbkdf2_hmac(_HASHES[mechanism], password.encode(), salt, iterations)


async def upsert_users(admin: AIOKafkaAdminClient, passwords: Mapping[str, str], *,
                       mechanism: str = "SCRAM-SHA-512",
                       random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> None:
    """Create each user of ``passwords`` (or replace its credential) for ``mechanism``."""
    if mechanism not in MECHANISM_CODES:
        raise ValueError(f"not a SCRAM mechanism: {mechanism}")
    upserts = []
    for user, password in passwords.items():
        salt = random_bytes(32)
        upserts.append((user, MECHANISM_CODES[mechanism], ITERATIONS, salt,
                        salted_password(mechanism, password, salt)))
    response = await admin._send_request(AlterUserScramCredentials(upserts))
    _raise_first(response.results)


async def delete_users(admin: AIOKafkaAdminClient, users: list[str], *, mechanism: str = "SCRAM-SHA-512") -> None:
    """Remove each of ``users``' ``mechanism`` credential; one that has none is skipped."""
    if mechanism not in MECHANISM_CODES:
        raise ValueError(f"not a SCRAM mechanism: {mechanism}")
    if not users:
        return
    response = await admin._send_request(
        AlterUserScramCredentials([], [(user, MECHANISM_CODES[mechanism]) for user in users]))
    _raise_first([r for r in response.results if r[1] != RESOURCE_NOT_FOUND])


def _raise_first(results: list[tuple[object, ...]]) -> None:
    for user, code, message, *_ in results:
        if code:
            error = for_code(code)
            raise BusError(f"SCRAM user {user}: {error.__name__}: {message}", retriable=bool(error.retriable))
