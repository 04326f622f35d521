"""``hadar identity``: the admin's enrolment of GPU nodes and users (:mod:`shared.security.identities`).

* ``hadar identity master-key --out FILE`` -- a new master key (hex, owner-only). The
  trusted services get it as ``HADAR_AUTHORSHIP_KEY_FILE``; nodes never do.
* ``hadar identity enrol node N --master-key-file F --registry R --out CRED`` -- enrols node
  N (or rotates its key: the old one stops working as soon as the services re-read R) and
  writes its credential, which the node's agent gets as ``HADAR_IDENTITY_FILE``.
* ``hadar identity enrol user U --registry R --out CRED`` -- enrols user U (or rotates its
  key) with a new Ed25519 key pair: the public half goes into R, the private half into the
  credential, which the user's ``hadar`` gets as ``HADAR_IDENTITY_FILE`` (it then submits and
  cancels as U, and only as U).
* ``hadar identity keygen user U --out CRED`` (the user) and ``hadar identity enrol user U
  --public-key HEX --master-key-file F --registry R --out LOGINS`` (the admin) -- the same
  with a key pair the user made: the private half never leaves the user, who adds the logins
  file to the credential with ``hadar identity add-logins --credential CRED --logins LOGINS``.
* ``hadar identity revoke node|user N --registry R`` -- its records are refused from then on.
* ``hadar identity ls --registry R`` -- the enrolled identities and their key epochs.

The registry is a small JSON file the trusted services read as ``HADAR_AUTHORSHIP_REGISTRY``
(and read again when it changes); it holds no secret.

A credential also carries its identity's own logins (:mod:`shared.security.logins`;
derived from the master key, so enrolling with ``--master-key-file``): a node's Kafka and
MinIO user ``hadar-node-<N>``, which act only as node N; a user's ``hadar-user-<U>``, which
submits and cancels jobs and writes only ``users/<U>/``. With the broker's admin and the
store's root in the environment (as the admin's env file has them), ``enrol`` creates or
rotates them at once and ``revoke`` removes them; without, ``hadar infra secure-init`` does
it from the registry on its next run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.bus.base import BusError
from shared.errors import ConfigError, HadarError, UsageError
from shared.security.files import write_private
from shared.security.identities import (
    KINDS,
    Credential,
    Registry,
    enrol,
    logins,
    new_master_key,
    new_user_key,
    node_identity,
    public_key_of,
    read_master_key,
    revoke,
    user_identity,
)
from shared.security.principals import ADMIN, login_of
from shared.store.settings import s3_from_env

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("identity", help="enrol, rotate and revoke the identities of GPU nodes and users (admin)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    key = actions.add_parser("master-key", help="write a new master key (owner-only file)")
    key.add_argument("--out", required=True, type=Path, help="file to write (refused if it exists)")
    key.set_defaults(func=_master_key)
    enrol = actions.add_parser("enrol", help="enrol a node or a user, or rotate its key; writes its credential")
    enrol.add_argument("kind", choices=KINDS)
    enrol.add_argument("name", help="the node id (as the agent's --node-id) or the user name (as a job's user)")
    enrol.add_argument("--master-key-file", type=Path,
                       help="the master key (a node's key and every identity's login secrets are derived from it)")
    enrol.add_argument("--registry", required=True, type=Path, help="the registry file (created if missing)")
    enrol.add_argument("--out", type=Path, help="where to write the credential (owner-only)")
    enrol.add_argument("--public-key", default=None, metavar="HEX",
                       help="a user: register this public key (from hadar identity keygen); --out then gets "
                            "the user's logins file, not a credential")
    enrol.set_defaults(func=_enrol)
    keygen = actions.add_parser("keygen", help="a user: make your own key pair; give the printed public key to "
                                               "the admin (hadar identity enrol user NAME --public-key HEX)")
    keygen.add_argument("kind", choices=("user",))
    keygen.add_argument("name", help="your user name")
    keygen.add_argument("--out", required=True, type=Path, help="your credential (owner-only; refused if it exists)")
    keygen.set_defaults(func=_keygen)
    add = actions.add_parser("add-logins", help="a user: add the logins file the admin gave you to your credential")
    add.add_argument("--credential", required=True, type=Path, help="your credential (from hadar identity keygen)")
    add.add_argument("--logins", required=True, type=Path, help="the logins file from the admin")
    add.set_defaults(func=_add_logins)
    revoke = actions.add_parser("revoke", help="revoke a node or user: its records are refused from then on")
    revoke.add_argument("kind", choices=KINDS)
    revoke.add_argument("name")
    revoke.add_argument("--registry", required=True, type=Path)
    revoke.set_defaults(func=_revoke)
    ls = actions.add_parser("ls", help="the enrolled and revoked identities, with key epochs (JSON)")
    ls.add_argument("--registry", required=True, type=Path)
    ls.set_defaults(func=_ls)


def _identity(kind: str, name: str) -> str:
    try:
        return node_identity(name) if kind == "node" else user_identity(name)
    except ValueError:
        shape = ("1-63 letters, digits, '-', '_' or '.'" if kind == "node"
                 else "1-63 lowercase letters, digits, '-', '_' or '.'")
        raise UsageError(f"{kind} {name!r}: a {kind} name is {shape}") from None


def _master_key(args: argparse.Namespace) -> int:
    if args.out.exists():
        raise UsageError(f"{args.out}: exists; a new master key would invalidate every credential made with it")
    write_private(args.out, new_master_key().hex() + "\n")
    print(f"master key written to {args.out}")
    return 0


def _enrol(args: argparse.Namespace) -> int:
    identity = _identity(args.kind, args.name)
    if args.kind == "node" and args.master_key_file is None:
        raise UsageError("--master-key-file: a node's key is derived from the master key")
    master = read_master_key(args.master_key_file) if args.master_key_file is not None else None
    if args.public_key is not None:
        if args.kind != "user":
            raise UsageError("--public-key: only a user brings a public key (a node's key is derived)")
        if master is not None and args.out is None:
            raise UsageError("--out: where to write the user's logins file (hadar identity add-logins reads it)")
        try:
            registry, epoch = Registry.read(args.registry).enrol(identity, bytes.fromhex(args.public_key))
        except ValueError:
            raise UsageError("--public-key: expected the 64 hex digits hadar identity keygen prints") from None
        write_private(args.registry, registry.to_text())
        print(f"{identity}: key epoch {epoch}; public key registered")
        if master is not None:
            write_private(args.out, json.dumps({"identity": identity, **logins(master, identity, epoch)}) + "\n")
            print(f"logins written to {args.out}: give it to {args.name} (hadar identity add-logins)")
            _logins(identity, args.registry, master, "created")
        return 0
    if args.out is None:
        raise UsageError("--out: where to write the credential (or, for a user, --public-key from keygen)")
    credential = enrol(identity, master=master, registry_path=args.registry)
    write_private(args.out, credential.to_text())
    print(f"{identity}: key epoch {credential.epoch}; credential written to {args.out}")
    if master is not None:
        _logins(identity, args.registry, master, "created")
    else:
        print(f"{identity}: no Kafka or store login without --master-key-file")
    return 0


def _add_logins(args: argparse.Namespace) -> int:
    credential = Credential.read(args.credential)
    try:
        given = json.loads(args.logins.read_text())
        identity = given.pop("identity")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        raise UsageError(f"{args.logins}: not a logins file "
                         "(hadar identity enrol user --public-key writes one)") from None
    if identity != credential.identity:
        raise UsageError(f"{args.logins} holds the logins of {identity}, the credential is {credential.identity}'s")
    merged = Credential.from_text(json.dumps({**json.loads(credential.to_text()), **given}), where=str(args.logins))
    write_private(args.credential, merged.to_text())
    print(f"{identity}: logins added to {args.credential}")
    return 0


def _logins(identity: str, registry_path: Path, master: bytes | None, done: str) -> None:
    """Apply ``identity``'s logins as the registry now says (made, rotated or removed) when
    the environment names the broker's admin and the store's root; else say who will."""
    import asyncio

    from shared.bus.settings import kafka_from_env
    from shared.security.logins import secure_kafka_logins, secure_stores
    from shared.security.provision import SetupError
    registry = Registry.read(registry_path)
    login = login_of(identity)
    try:
        kafka, root = kafka_from_env(), s3_from_env()
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    later = "hadar infra secure-init applies it"
    try:
        if kafka is not None and kafka.security.username == ADMIN:
            asyncio.run(secure_kafka_logins(kafka.bootstrap, kafka.security, registry, master, only=identity))
            print(f"kafka login {login}: {done}")
        else:
            print(f"kafka login {login}: not the broker's {ADMIN} here; {later}")
        if root is not None:
            secure_stores(root, registry, master, only=identity)
            print(f"store login {login}: {done}")
        else:
            print(f"store login {login}: no HADAR_S3_ENDPOINT here; {later}")
    except (SetupError, BusError) as exc:
        raise HadarError(f"the registry is updated, but {exc}; run hadar infra secure-init to retry") from None


def _keygen(args: argparse.Namespace) -> int:
    identity = _identity(args.kind, args.name)
    if args.out.exists():
        raise UsageError(f"{args.out}: exists; a new key pair would replace the enrolled one")
    private = new_user_key()
    write_private(args.out, Credential(identity=identity, epoch=1, key=private).to_text())
    print(public_key_of(private).hex())
    return 0


def _revoke(args: argparse.Namespace) -> int:
    identity = _identity(args.kind, args.name)
    try:
        revoke(identity, registry_path=args.registry)
    except KeyError:
        raise UsageError(f"{identity} is not enrolled in {args.registry}") from None
    print(f"{identity}: revoked")
    _logins(identity, args.registry, None, "removed")
    return 0


def _ls(args: argparse.Namespace) -> int:
    registry = Registry.read(args.registry)
    print(json.dumps({"enrolled": dict(registry.epochs), "revoked": dict(registry.retired),
                      "public_keys": {k: v.hex() for k, v in registry.public_keys.items()}}, indent=1))
    return 0
