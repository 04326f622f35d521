"""Secret values from the environment, or from the files docker secrets mount.

A secret named ``NAME`` is the variable's value, or else the content of the file that
``NAME_FILE`` names (stripped). Nothing here logs or prints a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shared.errors import ConfigError

__all__ = ["read_secret"]


def read_secret(env: Mapping[str, str], name: str, file_name: str) -> str:
    """``env[name]``, or else the content of the file ``env[file_name]`` (docker secrets)."""
    if env.get(name):
        return env[name]
    path = env.get(file_name, "")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{file_name}={path!r} cannot be read: {exc.strerror}") from None
