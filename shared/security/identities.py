"""Identities of GPU nodes and users, their keys, and the registry of who is enrolled.

* A node, ``node/<node id>``: its key is ``HMAC-SHA256(master, "hadar-authorship/v1" 0
  identity 0 epoch)``. The master key is held only by the trusted services and the admin;
  a node holds only its own derived key, so it cannot make another node's. Its logins --
  Kafka SCRAM user and MinIO user ``hadar-node-<node id>``, which may act only as that node
  (:mod:`shared.security.principals`) -- have secrets derived the same way under
  ``"hadar-kafka/v1"`` and ``"hadar-store/v1"`` (:func:`kafka_password`,
  :func:`store_secret`), so the setup can create or rotate every enrolled node's logins from
  the registry and the master key alone, and they change with the epoch.
* A user, ``user/<name>``: an Ed25519 key pair; the user holds the private half, the
  registry the public half, so anyone may check a user's seal (an agent too, which must
  not hold the master key) and nobody but the user can make one. Their logins (Kafka and
  MinIO user ``hadar-user-<name>``, which may submit jobs and write only ``users/<name>/``)
  have secrets derived as a node's; the admin hands them over in the credential, or in a
  logins file for a key pair the user made (``hadar identity add-logins``).

A :class:`Credential` is what an identity holds (its key and the key's epoch); the
:class:`Registry` is what verifiers read: the current epoch of every enrolled identity, a
user's public key, and the last epoch of every revoked one, so that enrolling it again
never reissues an old key. It holds no secret. :mod:`shared.security.authorship` seals and
checks records with them.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from shared.clock import Clock, SystemClock
from shared.errors import ConfigError
from shared.security.files import write_private
from shared.wire.records import NODE_ID_RE, USER_RE

__all__ = [
    "Credential", "Registry", "RegistryFile", "derive_key", "node_identity", "user_identity", "new_user_key",
    "public_key_of", "read_master_key", "new_master_key", "MASTER_KEY_BYTES", "REGISTRY_ENV", "KINDS", "enrol",
    "revoke", "store_secret", "kafka_password", "logins",
]

REGISTRY_ENV = "HADAR_AUTHORSHIP_REGISTRY"
MASTER_KEY_BYTES = 32
KINDS = ("node", "user")
_CONTEXT = b"hadar-authorship/v1"
_STORE_CONTEXT = b"hadar-store/v1"
_KAFKA_CONTEXT = b"hadar-kafka/v1"
_LOGIN_SECRET_RE = re.compile(r"(?:[0-9a-f]{40})?")


def user_identity(user: str) -> str:
    """The identity of a user: ``user/<name>``."""
    if not USER_RE.fullmatch(user):
        raise ValueError(f"not a user name: {user!r}")
    return f"user/{user}"


def new_user_key() -> bytes:
    """A new Ed25519 private key (its 32-byte seed), for a user's credential."""
    return Ed25519PrivateKey.generate().private_bytes_raw()


def public_key_of(private: bytes) -> bytes:
    """The 32-byte Ed25519 public key of a user's private seed."""
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def node_identity(node_id: str) -> str:
    """The identity of a GPU node: ``node/<node id>``."""
    if not NODE_ID_RE.fullmatch(node_id):
        raise ValueError(f"not a node id: {node_id!r}")
    return f"node/{node_id}"


def derive_key(master: bytes, identity: str, epoch: int) -> bytes:
    """A node's key at ``epoch`` (module docstring)."""
    return hmac.digest(master, b"\0".join((_CONTEXT, identity.encode(), str(epoch).encode())), "sha256")


def store_secret(master: bytes, identity: str, epoch: int) -> str:
    """A node's object-store secret at ``epoch`` (40 hex characters; module docstring)."""
    return _login_secret(_STORE_CONTEXT, master, identity, epoch)


def kafka_password(master: bytes, identity: str, epoch: int) -> str:
    """A node's Kafka SCRAM password at ``epoch`` (40 hex characters; module docstring)."""
    return _login_secret(_KAFKA_CONTEXT, master, identity, epoch)


def _login_secret(context: bytes, master: bytes, identity: str, epoch: int) -> str:
    return hmac.digest(master, b"\0".join((context, identity.encode(), str(epoch).encode())), "sha256")[:20].hex()


def new_master_key() -> bytes:
    return os.urandom(MASTER_KEY_BYTES)


def read_master_key(path: str | Path) -> bytes:
    """The master key in ``path`` (hex, as ``hadar identity master-key`` writes it)."""
    try:
        text = Path(path).read_text().strip()
        key = bytes.fromhex(text)
    except OSError as exc:
        raise ConfigError(f"authorship master key {str(path)!r} cannot be read: {exc.strerror}") from None
    except ValueError:
        raise ConfigError(f"authorship master key {str(path)!r}: expected hex") from None
    if len(key) != MASTER_KEY_BYTES:
        raise ConfigError(f"authorship master key {str(path)!r}: expected {MASTER_KEY_BYTES} bytes, got {len(key)}")
    return key


@dataclass(frozen=True, kw_only=True)
class Credential:
    """What an identity holds: the identity, the key's epoch and the key (a node's derived
    HMAC key, a user's Ed25519 private seed), and its logins' secrets (``kafka_password``,
    ``store_secret``; :func:`logins`). Not in repr: the secrets."""

    identity: str
    epoch: int
    key: bytes = field(repr=False)
    kafka_password: str = field(default="", repr=False)
    store_secret: str = field(default="", repr=False)

    def to_text(self) -> str:
        data: dict[str, object] = {"identity": self.identity, "epoch": self.epoch, "key": self.key.hex()}
        if self.kafka_password:
            data["kafka_password"] = self.kafka_password
        if self.store_secret:
            data["store_secret"] = self.store_secret
        return json.dumps(data) + "\n"

    @classmethod
    def from_text(cls, text: str, *, where: str) -> Credential:
        try:
            data = json.loads(text)
            identity, epoch, key = data["identity"], data["epoch"], bytes.fromhex(data["key"])
            logins = (data.get("kafka_password", ""), data.get("store_secret", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{where}: not a Hadar identity credential (hadar identity enrol writes one)") from None
        if (type(identity) is not str or type(epoch) is not int or epoch < 1 or len(key) != 32
                or not all(type(x) is str and _LOGIN_SECRET_RE.fullmatch(x) for x in logins)):
            raise ConfigError(f"{where}: not a Hadar identity credential (hadar identity enrol writes one)")
        return cls(identity=identity, epoch=epoch, key=key, kafka_password=logins[0], store_secret=logins[1])

    @classmethod
    def read(cls, path: str | Path) -> Credential:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"identity credential {str(path)!r} cannot be read: {exc.strerror}") from None
        return cls.from_text(text, where=f"identity credential {str(path)!r}")


@dataclass(frozen=True, kw_only=True)
class Registry:
    """The enrolled identities and the epoch of each one's current key; ``public_keys``: each
    enrolled user's Ed25519 public key (32 bytes) at that epoch; ``retired``: the last epoch
    of each revoked identity, so that enrolling it again never reissues an old key."""

    epochs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    retired: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    public_keys: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))

    def enrol(self, identity: str, public_key: bytes | None = None) -> tuple[Registry, int]:
        """This registry with ``identity`` given a fresh epoch (a new key; the old one stops
        working); a user's comes with its ``public_key``, a node's without."""
        if identity.startswith("user/") != (public_key is not None):
            raise ValueError("a user is enrolled with a public key, a node without one")
        if public_key is not None:
            Ed25519PublicKey.from_public_bytes(public_key)   # ValueError unless a valid 32-byte key
        epoch = max(self.epochs.get(identity, 0), self.retired.get(identity, 0)) + 1
        keys = {k: v for k, v in self.public_keys.items() if k != identity}
        if public_key is not None:
            keys[identity] = public_key
        retired = {k: v for k, v in self.retired.items() if k != identity}
        return Registry(epochs=MappingProxyType({**self.epochs, identity: epoch}),
                        retired=MappingProxyType(retired), public_keys=MappingProxyType(keys)), epoch

    def revoke(self, identity: str) -> Registry:
        if identity not in self.epochs:
            raise KeyError(identity)
        epochs = {k: v for k, v in self.epochs.items() if k != identity}
        keys = {k: v for k, v in self.public_keys.items() if k != identity}
        retired = {**self.retired, identity: self.epochs[identity]}
        return Registry(epochs=MappingProxyType(epochs), retired=MappingProxyType(retired),
                        public_keys=MappingProxyType(keys))

    def to_text(self) -> str:
        return json.dumps({"enrolled": dict(sorted(self.epochs.items())),
                           "public_keys": {k: v.hex() for k, v in sorted(self.public_keys.items())},
                           "revoked": dict(sorted(self.retired.items()))}, indent=1) + "\n"

    @classmethod
    def from_text(cls, text: str, *, where: str) -> Registry:
        try:
            data = json.loads(text)
            enrolled, revoked = data["enrolled"], data.get("revoked", {})
            keys = {k: bytes.fromhex(v) for k, v in data.get("public_keys", {}).items()}
            ok = (isinstance(enrolled, dict) and isinstance(revoked, dict)
                  and all(type(k) is str and type(v) is int and v >= 1 for part in (enrolled, revoked)
                          for k, v in part.items())
                  and all(k in enrolled and len(v) == 32 for k, v in keys.items())
                  and all((k in keys) == k.startswith("user/") for k in enrolled))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise ConfigError(f"{where}: not a Hadar identity registry (hadar identity enrol writes one)")
        return cls(epochs=MappingProxyType(dict(enrolled)), retired=MappingProxyType(dict(revoked)),
                   public_keys=MappingProxyType(keys))

    @classmethod
    def read(cls, path: str | Path) -> Registry:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise ConfigError(f"identity registry {str(path)!r} cannot be read: {exc.strerror}") from None
        return cls.from_text(text, where=f"identity registry {str(path)!r}")


class RegistryFile:
    """The registry in ``path``, read again when the file changes (checked at most every
    ``every_s``), so an enrolment or a revocation takes effect on running services. A file
    that turns unreadable or malformed keeps the last good registry (and ``error`` says why)."""

    def __init__(self, path: str | Path, *, clock: Clock | None = None, every_s: float = 1.0) -> None:
        self.path = Path(path)
        self._clock = clock or SystemClock()
        self._every_s = every_s
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        self.error: str | None = None
        if not self.path.is_file():   # a verifier with no registry would refuse every node: say so at start
            raise ConfigError(f"{REGISTRY_ENV}: no identity registry at {str(self.path)!r} "
                              "(hadar identity enrol creates it)")
        self._registry = Registry.read(self.path)   # a bad file at start is a config error
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def __call__(self) -> Registry:
        now = self._clock.time()
        if not self._next_check - self._every_s <= now < self._next_check:   # due, or the clock stepped back
            self._next_check = now + self._every_s
            stamp = self._stat()
            if stamp != self._stamp:
                try:
                    self._registry, self.error = Registry.read(self.path), None
                    self._stamp = stamp
                except ConfigError as exc:
                    self.error = str(exc)
        return self._registry


def enrol(identity: str, *, master: bytes | None, registry_path: Path) -> Credential:
    """Enrol ``identity`` (or rotate its key) in the registry file; its new credential. A
    node's key is derived from ``master`` (ValueError without it); a user's is a new Ed25519
    key pair. With ``master``, the credential carries the identity's logins (:func:`logins`)."""
    if identity.startswith("user/"):
        key = new_user_key()
        registry, epoch = Registry.read(registry_path).enrol(identity, public_key_of(key))
    else:
        if master is None:
            raise ValueError("a node's key is derived from the master key")
        registry, epoch = Registry.read(registry_path).enrol(identity)
        key = derive_key(master, identity, epoch)
    write_private(registry_path, registry.to_text())
    return Credential(identity=identity, epoch=epoch, key=key, **logins(master, identity, epoch))


def logins(master: bytes | None, identity: str, epoch: int) -> dict[str, str]:
    """The login secrets an identity's credential carries at ``epoch``: its Kafka password
    and its store secret; none without the master key."""
    if master is None:
        return {}
    return {"kafka_password": kafka_password(master, identity, epoch),
            "store_secret": store_secret(master, identity, epoch)}


def revoke(identity: str, *, registry_path: Path) -> None:
    """Revoke ``identity`` in the registry file (KeyError if it is not enrolled)."""
    write_private(registry_path, Registry.read(registry_path).revoke(identity).to_text())
