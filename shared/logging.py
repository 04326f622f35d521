"""structlog JSON logging, configured once per process.

Every log line is one JSON object with ``service`` and whatever context the caller bound
(``job``, ``round``, ``node``...). Secrets are never passed to loggers; as a last guard,
values of keys that look like secrets are masked.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SECRET_MARKERS = ("secret", "password", "token", "access_key")


def _mask_secrets(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    for key in list(event):
        if any(m in key.lower() for m in _SECRET_MARKERS):
            event[key] = "***"
    return event


def configure_logging(service: str, *, level: str = "INFO", stream: Any = None) -> None:
    logging.basicConfig(format="%(message)s", stream=stream or sys.stderr, level=level.upper(), force=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _mask_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(**bound: Any) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
