"""Create Kafka ACLs from :mod:`shared.security.principals`, through aiokafka's connection.

aiokafka 0.14's admin client has no ``create_acls`` and its protocol module only has
CreateAcls v0/v1, which Kafka 4 no longer accepts (KIP-896). This module adds the
flexible CreateAcls v2/v3 request (same fields as v1, compact encoding) and sends it
with the admin client's connection, so the dev broker, the stack's init service and the
tests create ACLs the same way, without a JVM per call.

Guarantees: :func:`apply_acls` is idempotent (Kafka keeps one copy of an identical
binding) and raises :class:`~shared.bus.base.BusError` naming the first binding the broker
refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from shared.bus.base import BusError
from shared.security.principals import PRINCIPALS, KafkaAcl, kafka_acls

__all__ = ["apply_acls", "all_acls"]

ALLOW = 3
ANY_HOST = "*"


class CreateAclsResponse_v2(Response):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    API_KEY = 30
    API_VERSION = 2
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("results", CompactArray(("error_code", Int16), ("error_message", CompactString("utf-8")),
                                 ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


class CreateAclsResponse_v3(Response):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    API_KEY = 30
    API_VERSION = 3
    SCHEMA = CreateAclsResponse_v2.SCHEMA


class CreateAclsRequest_v2(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    FLEXIBLE_VERSION = True
    API_KEY = 30
    API_VERSION = 2
    RESPONSE_TYPE = CreateAclsResponse_v2
    SCHEMA = Schema(
        ("creations", CompactArray(
            ("resource_type", Int8), ("resource_name", CompactString("utf-8")),
            ("resource_pattern_type", Int8), ("principal", CompactString("utf-8")),
            ("host", CompactString("utf-8")), ("operation", Int8), ("permission_type", Int8),
            ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


class CreateAclsRequest_v3(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    FLEXIBLE_VERSION = True
    API_KEY = 30
    API_VERSION = 3
    RESPONSE_TYPE = CreateAclsResponse_v3
    SCHEMA = CreateAclsRequest_v2.SCHEMA


_Struct: TypeAlias = CreateAclsRequest_v2 | CreateAclsRequest_v3


class CreateAcls(Request[_Struct]):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    API_KEY = 30

    def __init__(self, acls: list[KafkaAcl]) -> None:
        self._acls = acls

    def build(self, request_struct_class: type[_Struct]) -> _Struct:
        return request_struct_class(
            [(a.resource_type, a.resource_name, a.pattern_type, a.principal, ANY_HOST, a.operation, ALLOW, {})
             for a in self._acls],
            {})


def all_acls() -> list[KafkaAcl]:
    """Every binding of every principal in :data:`~shared.security.principals.PRINCIPALS` that
    has a login of its own (a node's are :func:`~shared.security.principals.node_kafka_acls`)."""
    return [acl for principal in PRINCIPALS.values() if principal.shared_login for acl in kafka_acls(principal)]


async def apply_acls(admin: AIOKafkaAdminClient, acls: Iterable[KafkaAcl] | None = None) -> int:
    """Create ``acls`` (default: :func:`all_acls`) with a started admin client of a super
    user; returns how many bindings were sent."""
    wanted = list(all_acls() if acls is None else acls)
    if not wanted:
        return 0
    response = await admin._send_request(CreateAcls(wanted))
    for acl, (code, message, *_rest) in zip(wanted, response.results, strict=True):
        if code:
            error = for_code(code)
            raise BusError(f"create ACL {acl.principal} op {acl.operation} on {acl.resource_name}: "
                           f"{error.__name__}: {message}", retriable=bool(error.retriable))
    return len(wanted)
