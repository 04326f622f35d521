"""The root of every error Hadar raises on purpose.

Callers that only need to know "can this be tried again?" catch :class:`HadarError` and
read ``retriable``: True for failures of something outside the process that may recover
by itself (a broker or object store that is away), False for input that will be just as
wrong next time (a malformed event, a bad flag, an impossible plan). Errors raised by
libraries are wrapped at the module that talks to the library, never leaked raw.
"""

from __future__ import annotations

__all__ = ["HadarError", "UsageError", "ConfigError"]


class HadarError(Exception):
    """Base of Hadar's own errors; ``retriable`` says whether trying again may succeed."""

    retriable: bool = False

    def __init__(self, *args: object, retriable: bool | None = None) -> None:
        super().__init__(*args)
        if retriable is not None:
            self.retriable = retriable


class UsageError(HadarError):
    """Bad input from the user (a flag, a file, a setting): one line, exit code 2 in the CLI."""


class ConfigError(UsageError):
    """A setting that is present but unusable; the message names the variable or flag."""
