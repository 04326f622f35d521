"""Run as ``python launch.py --nofile N --fsize B [--as-bytes B] (--sandbox-json POLICY | --no-sandbox)
-- PYTHON SCRIPT ARGS...``: the first code of a user's trainer process.

In this order, it lowers the process's resource limits (soft and hard, so the script cannot
raise them again) and turns core dumps off; applies the sandbox
(:func:`services.agent.usercode.sandbox.apply_sandbox`: no capability, no new privileges, the
Landlock allow-list of ``--sandbox-json``, the seccomp filter); then replaces itself with the
user's script.

**Fails closed:** when Landlock is unavailable, the machine has no seccomp table, or any step
of the sandbox fails, it writes one line to stderr and exits with code 126 without running
the script. ``--no-sandbox`` is
the operator's opt-out for development on a kernel without Landlock, and is insecure: the
script can then read whatever the trainer's uid can (the checkout, its secrets).

Trusted code, but it runs in the untrusted process: it holds no more than that process will
(the harness scrubbed the environment before starting it). It imports only the standard
library and the sandbox module, so it starts in a few milliseconds and from any folder.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

REFUSED = 126   # the shell's "found but cannot run"


def _lower(kind: int, value: int) -> None:
    _soft, hard = resource.getrlimit(kind)
    cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (cap, cap))


def _refuse(message: str) -> None:
    sys.stderr.write(f"launch: {message}\n")
    sys.stderr.flush()
    os._exit(REFUSED)


def main(argv: list[str]) -> None:
    from services.agent.usercode.sandbox import SandboxError, SandboxPolicy, apply_sandbox

    parser = argparse.ArgumentParser(prog="launch")
    parser.add_argument("--nofile", type=int, required=True)
    parser.add_argument("--fsize", type=int, required=True)
    parser.add_argument("--as-bytes", type=int, default=0)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sandbox-json", help="the SandboxPolicy, as SandboxPolicy.to_json writes it")
    mode.add_argument("--no-sandbox", action="store_true", help="run unsandboxed (insecure: development only)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _lower(resource.RLIMIT_NOFILE, args.nofile)
    _lower(resource.RLIMIT_FSIZE, args.fsize)
    if args.as_bytes:
        _lower(resource.RLIMIT_AS, args.as_bytes)
    if not args.no_sandbox:
        try:
            apply_sandbox(SandboxPolicy.from_json(args.sandbox_json))
        except SandboxError as exc:
            _refuse(f"refusing to run the trainer unsandboxed: {exc} (--no-sandbox opts out, insecurely)")
    try:
        os.execv(command[0], command)
    except OSError as exc:
        _refuse(f"cannot run {command[0]}: {exc.strerror}")


if __name__ == "__main__":
    if not __package__:   # run as a file: import the sandbox from the checkout this file is in
        sys.path[0] = str(Path(__file__).resolve().parents[3])
    main(sys.argv[1:])
