"""Who wrote an event: per-node identities, sealed records, and the check every trusted consumer makes.

Kafka's ACLs say which *principal* may write a topic, and every GPU node shares the ``agent``
principal, so by itself the bus cannot stop node n1 from announcing the copy placed on n2.
Each node therefore holds its own identity, ``node/<node id>``, and a key for it; the node's
bus seals every record it publishes (:mod:`shared.wire.sealed`: the event's bytes, the
identity, the key's epoch and an HMAC-SHA256 of the bytes), and the bus of each trusted
service (scheduler, tracker, profiler) opens every record through a :class:`Verifier`.

Keys: ``key(identity, epoch) = HMAC-SHA256(master, "hadar-authorship/v1" 0 identity 0 epoch)``.
The master key is held only by the trusted services and the admin who enrols nodes
(``hadar identity``); a node holds only its own derived key (its *credential*), so a node
cannot make another node's key, and verifying needs no list of keys, only the
:class:`Registry` of enrolled identities and their current epochs. Rotating a node's key
raises its epoch; revoking removes it; an epoch once used is never handed out again.
HMAC rather than signatures: a check costs ~2 us, and a node's records are the busiest
stream (benchmarks/codec.py); the price is that verifiers hold the master key, which is
no new trust: they already decide every placement and every model.

Guarantees of :meth:`Verifier.open` (each refusal an :class:`InvalidEvent` whose reason
starts ``authorship:``, so the bus dead-letters the record with it):

* a sealed record is accepted only if its identity is enrolled, its epoch is the current
  one, and its MAC is right; then its inner event is decoded as usual;
* an event that claims a node (:func:`claimed_author`: NodeRegistered, NodeHeartbeat,
  Progress, CopyFinished name their ``node_id``) is accepted only if sealed by that node:
  an unsealed one, or one sealed by another identity, is refused;
* every other event is accepted sealed (checked as above) or not: its topic's ACL already
  names its one writer.

What it does not cover: a node may still lie about its *own* copies; the consumers check
those against the Assignment (the copy must be placed on that node) and the tracker screens
the replica (:mod:`shared.domain.replica_screen`).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from shared.bus.base import Bus
from shared.clock import Clock, SystemClock
from shared.errors import ConfigError
from shared.wire.events import (
    CopyFinished,
    Event,
    InvalidEvent,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    decode,
)
from shared.wire.records import NODE_ID_RE
from shared.wire.sealed import seal, unseal

__all__ = [
    "Credential", "Registry", "Sealer", "Verifier", "RegistryFile", "derive_key", "claimed_author",
    "node_identity", "read_master_key", "new_master_key", "MASTER_KEY_BYTES",
    "authorship_from_env", "with_authorship", "IDENTITY_ENV", "KEY_ENV", "REGISTRY_ENV", "REFUSALS",
    "VERIFYING_PRINCIPALS",
]

IDENTITY_ENV = "HADAR_IDENTITY_FILE"            # a node's credential: its bus seals what it publishes
KEY_ENV = "HADAR_AUTHORSHIP_KEY_FILE"           # the master key: a trusted service's bus verifies
REGISTRY_ENV = "HADAR_AUTHORSHIP_REGISTRY"      # ... against the enrolled identities in this file

MASTER_KEY_BYTES = 32
# Why a Verifier refused a record: not sealed though it claims a node; sealed by an identity
# not enrolled; with a key rotated away; a MAC that does not match; by a node other than the
# one the event claims.
REFUSALS = ("unsealed", "not_enrolled", "old_key", "bad_mac", "other_author")
# The principals whose buses verify: the trusted services that read the nodes' topics.
VERIFYING_PRINCIPALS = ("scheduler", "tracker", "profiler")
_CONTEXT = b"hadar-authorship/v1"
_NODE_EVENTS = (NodeRegistered, NodeHeartbeat, Progress, CopyFinished)


def node_identity(node_id: str) -> str:
    """The identity of a GPU node: ``node/<node id>``."""
    if not NODE_ID_RE.fullmatch(node_id):
        raise ValueError(f"not a node id: {node_id!r}")
    return f"node/{node_id}"


def derive_key(master: bytes, identity: str, epoch: int) -> bytes:
    """The key of ``identity`` at ``epoch`` (module docstring)."""
    return hmac.digest(master, b"\0".join((_CONTEXT, identity.encode(), str(epoch).encode())), "sha256")


def claimed_author(event: Event) -> str | None:
    """The identity that alone may publish ``event``, or None if its topic's ACL suffices."""
    if isinstance(event, _NODE_EVENTS):
        return f"node/{event.node_id}"
    return None


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
    """What a node holds: its identity, the key's epoch and the key. Not in repr: the key."""

    identity: str
    epoch: int
    key: bytes = field(repr=False)

    def to_text(self) -> str:
        return json.dumps({"identity": self.identity, "epoch": self.epoch, "key": self.key.hex()}) + "\n"

    @classmethod
    def from_text(cls, text: str, *, where: str) -> Credential:
        try:
            data = json.loads(text)
            identity, epoch, key = data["identity"], data["epoch"], bytes.fromhex(data["key"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{where}: not a Hadar identity credential (hadar identity enrol writes one)") from None
        if type(identity) is not str or type(epoch) is not int or epoch < 1 or len(key) != 32:
            raise ConfigError(f"{where}: not a Hadar identity credential (hadar identity enrol writes one)")
        return cls(identity=identity, epoch=epoch, key=key)

    @classmethod
    def read(cls, path: str | Path) -> Credential:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"identity credential {str(path)!r} cannot be read: {exc.strerror}") from None
        return cls.from_text(text, where=f"identity credential {str(path)!r}")


@dataclass(frozen=True, kw_only=True)
class Registry:
    """The enrolled identities and the epoch of each one's current key; ``retired``: the
    last epoch of each revoked identity, so that enrolling it again never reissues an old key."""

    epochs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    retired: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def enrol(self, identity: str) -> tuple[Registry, int]:
        """This registry with ``identity`` given a fresh epoch (a new key; the old one stops working)."""
        epoch = max(self.epochs.get(identity, 0), self.retired.get(identity, 0)) + 1
        epochs = {**self.epochs, identity: epoch}
        retired = {k: v for k, v in self.retired.items() if k != identity}
        return Registry(epochs=MappingProxyType(epochs), retired=MappingProxyType(retired)), epoch

    def revoke(self, identity: str) -> Registry:
        if identity not in self.epochs:
            raise KeyError(identity)
        epochs = {k: v for k, v in self.epochs.items() if k != identity}
        retired = {**self.retired, identity: self.epochs[identity]}
        return Registry(epochs=MappingProxyType(epochs), retired=MappingProxyType(retired))

    def to_text(self) -> str:
        return json.dumps({"enrolled": dict(sorted(self.epochs.items())),
                           "revoked": dict(sorted(self.retired.items()))}, indent=1) + "\n"

    @classmethod
    def from_text(cls, text: str, *, where: str) -> Registry:
        try:
            data = json.loads(text)
            enrolled, revoked = data["enrolled"], data.get("revoked", {})
            ok = (isinstance(enrolled, dict) and isinstance(revoked, dict)
                  and all(type(k) is str and type(v) is int and v >= 1 for part in (enrolled, revoked)
                          for k, v in part.items()))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise ConfigError(f"{where}: not a Hadar identity registry (hadar identity enrol writes one)")
        return cls(epochs=MappingProxyType(dict(enrolled)), retired=MappingProxyType(dict(revoked)))

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


class Sealer:
    """Seals what one identity publishes."""

    def __init__(self, credential: Credential) -> None:
        self.identity = credential.identity
        self._epoch = credential.epoch
        self._key = credential.key

    def __repr__(self) -> str:
        return f"Sealer({self.identity!r}, epoch={self._epoch})"

    def seal(self, inner: bytes) -> bytes:
        return seal(inner, by=self.identity, epoch=self._epoch, mac=hmac.digest(self._key, inner, "sha256"))


class Verifier:
    """Opens records for a trusted consumer; see the module guarantees."""

    def __init__(self, master: bytes, registry: Callable[[], Registry]) -> None:
        if len(master) != MASTER_KEY_BYTES:
            raise ValueError(f"master key: expected {MASTER_KEY_BYTES} bytes")
        self._master = master
        self._registry = registry
        self._keys: dict[tuple[str, int], bytes] = {}
        self.refusals: dict[str, int] = dict.fromkeys(REFUSALS, 0)   # by kind, for /metrics

    def __repr__(self) -> str:
        return "Verifier()"

    def _refuse(self, kind: str, reason: str) -> InvalidEvent:
        self.refusals[kind] += 1
        return InvalidEvent(f"authorship: {reason}")

    def open(self, data: bytes) -> Event:
        sealed = unseal(data)
        if sealed is None:
            event = decode(data)
            claim = claimed_author(event)
            if claim is not None:
                raise self._refuse("unsealed", f"{event.TYPE} for {claim} is not sealed")
            return event
        current = self._registry().epochs.get(sealed.by)
        if current is None:
            raise self._refuse("not_enrolled", f"{sealed.by[:80]!r} is not enrolled (or was revoked)")
        if sealed.epoch != current:
            raise self._refuse("old_key", f"{sealed.by} sealed with key epoch {sealed.epoch}, "
                                          f"the current one is {current}")
        key = self._keys.get((sealed.by, current))
        if key is None:
            if len(self._keys) > 65536:
                self._keys.clear()
            key = self._keys[(sealed.by, current)] = derive_key(self._master, sealed.by, current)
        if not hmac.compare_digest(hmac.digest(key, sealed.inner, "sha256"), sealed.mac):
            raise self._refuse("bad_mac", f"bad MAC on a record sealed as {sealed.by}")
        event = decode(sealed.inner)
        claim = claimed_author(event)
        if claim is not None and claim != sealed.by:
            raise self._refuse("other_author", f"{event.TYPE} for {claim} sealed by {sealed.by}")
        return event


def authorship_from_env(env: Mapping[str, str], *, clock: Clock | None = None
                        ) -> tuple[Sealer | None, Verifier | None]:
    """The sealer (``HADAR_IDENTITY_FILE``) and the verifier (``HADAR_AUTHORSHIP_KEY_FILE``
    with ``HADAR_AUTHORSHIP_REGISTRY``) the environment gives a process; each None if unset.
    A verifier's two variables come together; a bad file is a :class:`ConfigError`."""
    identity, key, registry = (env.get(name, "").strip() for name in (IDENTITY_ENV, KEY_ENV, REGISTRY_ENV))
    sealer = Sealer(Credential.read(identity)) if identity else None
    if bool(key) != bool(registry):
        raise ConfigError(f"{KEY_ENV} and {REGISTRY_ENV} are set together (a verifier needs both)")
    verifier = Verifier(read_master_key(key), RegistryFile(registry, clock=clock)) if key else None
    return sealer, verifier


def with_authorship(bus: Bus, env: Mapping[str, str]) -> Bus:
    """``bus`` sealing and verifying as ``env`` says (:func:`authorship_from_env`)."""
    bus.sealer, bus.verifier = authorship_from_env(env)
    return bus
