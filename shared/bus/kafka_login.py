"""The client side of Kafka security for :class:`~shared.bus.kafka.KafkaBus`: aiokafka
options from :class:`~shared.bus.settings.KafkaSecurity`, and a diagnosis when a connection fails.

aiokafka reports a failed TLS handshake or SASL authentication during bootstrap only as
"Unable to bootstrap" (the cause goes to its log). :func:`diagnose` connects once more to
the first bootstrap server with the same settings and turns what it meets into one line
naming the setting to fix -- ``HADAR_KAFKA_CA_FILE`` for a certificate that does not
verify, ``HADAR_KAFKA_USERNAME``/``HADAR_KAFKA_PASSWORD`` for a refused login,
``HADAR_KAFKA_SECURITY_PROTOCOL`` when the broker speaks another protocol. It never
includes the password and always returns within ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import KafkaError
from aiokafka.helpers import create_ssl_context

from shared.bus.settings import KafkaSecurity
from shared.errors import ConfigError

__all__ = ["security_options", "diagnose"]


def security_options(security: KafkaSecurity) -> dict[str, Any]:
    """aiokafka client options for ``security`` (an SSL context built now, from its files).

    Raises :class:`~shared.errors.ConfigError` naming the variable of a file that cannot be
    read or parsed.
    """
    options: dict[str, Any] = {"security_protocol": security.protocol}
    if security.tls:
        options["ssl_context"] = _ssl_context(security)
    if security.sasl:
        options.update(sasl_mechanism=security.mechanism, sasl_plain_username=security.username,
                       sasl_plain_password=security.password)
    return options


def _ssl_context(security: KafkaSecurity) -> ssl.SSLContext:
    try:
        context: ssl.SSLContext = create_ssl_context(cafile=security.ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"HADAR_KAFKA_CA_FILE={security.ca_file!r}: cannot be used: {_reason(exc)}") from None
    if security.cert_file:
        try:
            context.load_cert_chain(security.cert_file, security.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"HADAR_KAFKA_CERT_FILE={security.cert_file!r}: cannot be used: "
                              f"{_reason(exc)}") from None
    return context


async def diagnose(bootstrap: str, security: KafkaSecurity, *, timeout_s: float = 10.0) -> str | None:
    """Why a client with ``security`` cannot talk to the first server of ``bootstrap``, as
    one line naming the setting to fix; ``None`` when it can (or the cause is not security)."""
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    address = f"{host}:{port}"
    try:
        conn = await asyncio.wait_for(
            create_conn(host, int(port), request_timeout_ms=int(timeout_s * 1000), **security_options(security)),
            timeout_s)
    except ssl.SSLCertVerificationError as exc:
        return (f"HADAR_KAFKA_CA_FILE: the certificate of the kafka broker at {address} is not trusted "
                f"({exc.verify_message}); point HADAR_KAFKA_CA_FILE at the CA that signed it")
    except ssl.SSLError as exc:
        return (f"HADAR_KAFKA_SECURITY_PROTOCOL={security.protocol}: TLS with the kafka broker at {address} "
                f"failed ({_reason(exc)}); does that listener speak {security.protocol}?")
    except KafkaError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (f"HADAR_KAFKA_CA_FILE: the certificate of the kafka broker at {address} is not trusted "
                    f"({cause.verify_message}); point HADAR_KAFKA_CA_FILE at the CA that signed it")
        name = type(exc).__name__
        if "Authentication" in name or "SaslAuthentication" in name or "Sasl" in name:
            return (f"HADAR_KAFKA_USERNAME/HADAR_KAFKA_PASSWORD: the kafka broker at {address} refused "
                    f"{security.mechanism} login as {security.username!r} (wrong username or password)")
        if "UnsupportedSaslMechanism" in name or "IllegalSaslState" in name:
            return (f"HADAR_KAFKA_SASL_MECHANISM={security.mechanism}: the kafka broker at {address} "
                    f"does not accept it ({name})")
        return None
    except (TimeoutError, OSError):
        return None
    conn.close()
    return None


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc)
