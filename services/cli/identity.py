"""``hadar identity``: the admin's enrolment of GPU nodes (:mod:`shared.security.authorship`).

* ``hadar identity master-key --out FILE`` -- a new master key (hex, owner-only). The
  trusted services get it as ``HADAR_AUTHORSHIP_KEY_FILE``; nodes never do.
* ``hadar identity enrol node N --master-key-file F --registry R --out CRED`` -- enrols node
  N (or rotates its key: the old one stops working as soon as the services re-read R) and
  writes its credential, which the node's agent gets as ``HADAR_IDENTITY_FILE``.
* ``hadar identity revoke node N --registry R`` -- the node's records are refused from then on.
* ``hadar identity ls --registry R`` -- the enrolled identities and their key epochs.

The registry is a small JSON file the trusted services read as ``HADAR_AUTHORSHIP_REGISTRY``
(and read again when it changes); it holds no secret.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.errors import UsageError
from shared.security.authorship import (
    Credential,
    Registry,
    derive_key,
    new_master_key,
    node_identity,
    read_master_key,
)
from shared.security.files import write_private

__all__ = ["register"]

KINDS = ("node",)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("identity", help="enrol, rotate and revoke GPU nodes' identities (admin)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    key = actions.add_parser("master-key", help="write a new master key (owner-only file)")
    key.add_argument("--out", required=True, type=Path, help="file to write (refused if it exists)")
    key.set_defaults(func=_master_key)
    enrol = actions.add_parser("enrol", help="enrol a node, or rotate its key; writes its credential")
    enrol.add_argument("kind", choices=KINDS)
    enrol.add_argument("name", help="the node id (as the agent's --node-id)")
    enrol.add_argument("--master-key-file", required=True, type=Path)
    enrol.add_argument("--registry", required=True, type=Path, help="the registry file (created if missing)")
    enrol.add_argument("--out", required=True, type=Path, help="where to write the node's credential")
    enrol.set_defaults(func=_enrol)
    revoke = actions.add_parser("revoke", help="revoke a node: its records are refused from then on")
    revoke.add_argument("kind", choices=KINDS)
    revoke.add_argument("name")
    revoke.add_argument("--registry", required=True, type=Path)
    revoke.set_defaults(func=_revoke)
    ls = actions.add_parser("ls", help="the enrolled and revoked identities, with key epochs (JSON)")
    ls.add_argument("--registry", required=True, type=Path)
    ls.set_defaults(func=_ls)


def _identity(kind: str, name: str) -> str:
    try:
        return node_identity(name)
    except ValueError:
        raise UsageError(f"{kind} {name!r}: a node id is 1-63 letters, digits, '-', '_' or '.'") from None


def _master_key(args: argparse.Namespace) -> int:
    if args.out.exists():
        raise UsageError(f"{args.out}: exists; a new master key would invalidate every credential made with it")
    write_private(args.out, new_master_key().hex() + "\n")
    print(f"master key written to {args.out}")
    return 0


def enrol(identity: str, *, master: bytes, registry_path: Path) -> Credential:
    """Enrol ``identity`` (or rotate its key) in the registry file; its new credential."""
    registry, epoch = Registry.read(registry_path).enrol(identity)
    write_private(registry_path, registry.to_text())
    return Credential(identity=identity, epoch=epoch, key=derive_key(master, identity, epoch))


def revoke(identity: str, *, registry_path: Path) -> None:
    try:
        registry = Registry.read(registry_path).revoke(identity)
    except KeyError:
        raise UsageError(f"{identity} is not enrolled in {registry_path}") from None
    write_private(registry_path, registry.to_text())


def _enrol(args: argparse.Namespace) -> int:
    identity = _identity(args.kind, args.name)
    credential = enrol(identity, master=read_master_key(args.master_key_file), registry_path=args.registry)
    write_private(args.out, credential.to_text())
    print(f"{identity}: key epoch {credential.epoch}; credential written to {args.out}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    identity = _identity(args.kind, args.name)
    revoke(identity, registry_path=args.registry)
    print(f"{identity}: revoked")
    return 0


def _ls(args: argparse.Namespace) -> int:
    registry = Registry.read(args.registry)
    print(json.dumps({"enrolled": dict(registry.epochs), "revoked": dict(registry.retired)}, indent=1))
    return 0
