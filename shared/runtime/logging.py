"""structlog JSON logging, configured once per process.

Once :func:`configure_logging` has run, every line the process logs is exactly one JSON
object (keys sorted), whichever way it was logged:

* through structlog (``structlog.get_logger(__name__)``);
* through the standard library's :mod:`logging` -- aiokafka, asyncio, aiohttp, urllib3...;
* through :mod:`warnings` (torch's and numpy's ``UserWarning``\\ s): ``logging.captureWarnings``;
* as an uncaught exception (main thread or any other), an "exception ignored" (unraisable)
  one, or a record that logging itself failed to format.

Every object carries the stable keys ``timestamp`` (ISO 8601, UTC), ``level`` (``debug``,
``info``, ``warning``, ``error``, ``critical``), ``event`` (the message), ``logger`` (the
standard library logger's name, e.g. ``aiokafka.consumer.group_coordinator``; for
structlog, the name it was given or the calling module) and ``service``, plus the context
bound with ``.bind()`` or :func:`structlog.contextvars.bind_contextvars` (``job``,
``round``, ``node``...). An exception is one string field, ``exception`` (the formatted
traceback, newlines escaped like any JSON string). All records go through one handler, so
lines from different threads never interleave. Secrets are never passed to loggers; as a
last guard, values of keys that look like secrets are masked on every path.

Not covered: bytes that C code or a child process writes straight to file descriptor 2
(or 1), which bypass Python; and a console handler that a library adds to its own
non-propagating logger after this ran.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import traceback
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["configure_logging", "capture_prints", "STABLE_KEYS"]

STABLE_KEYS = frozenset({"timestamp", "level", "event", "logger", "service"})   # in every line
_SECRET_MARKERS = ("secret", "password", "token", "access_key")
UNCAUGHT_LOGGER = "hadar.uncaught"
UNRAISABLE_LOGGER = "hadar.unraisable"


def _mask_secrets(_: Any, __: str, event: EventDict) -> EventDict:
    for key in list(event):
        if any(m in key.lower() for m in _SECRET_MARKERS):
            event[key] = "***"
    return event


def _add_service(service: str) -> Processor:
    """Fill ``service`` where no context bound one (threads do not inherit the main context)."""
    def add(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
        event.setdefault("service", service)
        return event
    return add


def _strip_event(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    # logging.captureWarnings hands over "file:line: Category: text\n  source line\n".
    if isinstance(event.get("event"), str):
        event["event"] = event["event"].rstrip()
    return event


def _formatter(service: str) -> structlog.stdlib.ProcessorFormatter:
    """Renders structlog's events and foreign (standard library) records alike."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[_strip_event],
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _add_service(service),
            _mask_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
    )


class _JsonLinesHandler(logging.StreamHandler[TextIO]):
    """A StreamHandler whose own failures are reported as one JSON line too."""

    def __init__(self, stream: TextIO, service: str) -> None:
        super().__init__(stream)
        self._service = service

    def handleError(self, record: logging.LogRecord) -> None:
        # The default prints a multi-line "--- Logging error ---" report (a library's bad
        # format arguments are enough to cause one).
        try:
            line = json.dumps({
                "event": f"could not format a log record: {str(record.msg)[:500]}",
                "exception": traceback.format_exc().rstrip(), "level": "error", "logger": record.name,
                "service": self._service,
                "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            }, sort_keys=True, default=repr)
            self.stream.write(line + "\n")
            self.flush()
        except Exception:   # nowhere left to report to (a closed stream)
            pass


def _prints_to_console(handler: logging.Handler) -> bool:
    if isinstance(handler, _JsonLinesHandler):   # an earlier configure_logging's
        return True
    if isinstance(handler, logging.FileHandler):
        return False
    stream = getattr(handler, "stream", None)   # not only StreamHandlers: torch's follows sys.stderr
    if stream is None:
        return False
    if stream in (sys.stderr, sys.__stderr__, sys.stdout, sys.__stdout__):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


def _adopt_console_handlers(handler: logging.Handler) -> None:
    """Replace the console handlers of loggers that print to the console themselves.

    torch, for one, gives its loggers (``torch.distributed``, ``torch._dynamo``...) their
    own stderr handler and ``propagate = False``: their records never reach the root, so
    such a logger gets ``handler``. A propagating logger just loses its console handler
    (its records reach the root's; two would print each record twice). Levels and
    ``propagate`` are kept: only where the text goes changes.
    """
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):   # a PlaceHolder: no handlers
            continue
        strays = [h for h in logger.handlers if _prints_to_console(h)]
        for stray in strays:
            logger.removeHandler(stray)
        if strays and not logger.propagate:
            logger.addHandler(handler)


def _install_hooks(also_default: bool) -> None:
    """Send uncaught and unraisable exceptions through logging.

    ``also_default``: run Python's own hook as well, for processes that log to a file, so
    that a crash still shows on the terminal.
    """
    uncaught = logging.getLogger(UNCAUGHT_LOGGER)

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        uncaught.critical("uncaught exception", exc_info=(exc_type, exc, tb))
        if also_default:
            sys.__excepthook__(exc_type, exc, tb)

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:   # as the default hook: a thread's sys.exit() is silent
            return
        name = args.thread.name if args.thread is not None else "?"
        # exc_value is None for a thread that raised no instance; logging formats that as well
        uncaught.critical("uncaught exception in thread %s", name,
                          exc_info=(args.exc_type, args.exc_value,  # type: ignore[arg-type]  # value may be None
                                    args.exc_traceback))
        if also_default:
            threading.__excepthook__(args)

    def unraisablehook(args: Any) -> None:   # sys.UnraisableHookArgs
        try:
            what = args.err_msg or "Exception ignored in"
            logging.getLogger(UNRAISABLE_LOGGER).warning(
                "%s: %s", what, _safe_repr(args.object),
                exc_info=(args.exc_type, args.exc_value, args.exc_traceback) if args.exc_type else None)
        except Exception:   # e.g. during interpreter shutdown
            sys.__unraisablehook__(args)
            return
        if also_default:
            sys.__unraisablehook__(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    sys.unraisablehook = unraisablehook


def _safe_repr(obj: object) -> str:
    try:
        return repr(obj)[:300]
    except Exception:
        return f"<{type(obj).__name__} object (repr failed)>"


def configure_logging(service: str, *, level: str = "INFO", stream: Any = None) -> None:
    """Make this process log one JSON object per line to ``stream`` (default: stderr).

    Replaces the root logger's handlers (calling it again reconfigures) and those that
    loggers already created print to the console with, captures :mod:`warnings` and
    installs the exception hooks described in the module docstring.
    ``service`` is bound to the context of the calling thread and filled in wherever no
    context bound another.
    """
    target: TextIO = stream or sys.stderr
    numeric = logging.getLevelName(level.upper())
    handler = _JsonLinesHandler(target, service)
    handler.setFormatter(_formatter(service))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    # One line per replay consumer it starts (a standby reads hadar.leadership every few seconds).
    logging.getLogger("aiokafka.consumer.subscription_state").setLevel(max(numeric, logging.WARNING))
    _adopt_console_handlers(handler)
    logging.captureWarnings(True)
    _install_hooks(also_default=target not in (sys.stderr, sys.__stderr__))
    structlog.configure(
        processors=[structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


class _PrintsToLog(io.TextIOBase):
    """A text stream that logs each complete line written to it as one record."""

    def __init__(self, logger: logging.Logger, underlying: TextIO) -> None:
        super().__init__()
        self._logger = logger
        self._underlying = underlying
        self._pending = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:   # type: ignore[override]  # TextIOBase declares a plain attribute
        return "utf-8"

    @property
    def errors(self) -> str:   # type: ignore[override]  # TextIOBase declares a plain attribute
        return "strict"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._underlying.fileno()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            if line.strip():
                self._logger.info(line.rstrip("\r"))
        return len(text)

    def close(self) -> None:
        with self._lock:
            rest, self._pending = self._pending, ""
        if rest.strip():
            self._logger.info(rest)
        super().close()


def capture_prints(logger_name: str = "stdout") -> None:
    """Route what Python code prints to ``sys.stdout`` through logging, one record per line.

    For a process whose real stdout is reserved (a worker's protocol) and whose fd 1 was
    pointed at stderr: library prints then become JSON lines rather than raw text. Output
    written to the file descriptor directly is not seen.
    """
    sys.stdout = _PrintsToLog(logging.getLogger(logger_name), sys.stdout)
