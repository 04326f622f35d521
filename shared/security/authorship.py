"""Who wrote an event: sealed records, and the check every consumer that acts on them makes.

Kafka's ACLs say which *principal* may write a topic, and every GPU node shares the ``agent``
principal and every user the ``cli`` one, so by itself the bus cannot stop node n1 from
announcing the copy placed on n2, nor bob from submitting as alice or cancelling her job.
Each node and user therefore holds its own identity and key (:mod:`shared.security.identities`);
its bus seals every record it publishes (:mod:`shared.wire.sealed`: the event's bytes, the
identity, the key's epoch, and a node's HMAC-SHA256 or a user's Ed25519 signature of the
bytes), and the bus of each consumer opens every record through a :class:`Verifier`: the
trusted services (scheduler, tracker, profiler) with the master key and the registry, an
agent with the registry alone (it checks users' signatures, never a node's MAC).

Nodes use HMAC (a check costs ~2 us; a node's records are the busiest stream,
benchmarks/codec.py): the price is that verifiers hold the master key, no new trust, since
they already decide every placement and every model. Users sign (Ed25519): their records
are rare, and an agent must check a cancellation without being able to make one.

Guarantees of :meth:`Verifier.open` (each refusal an :class:`InvalidEvent` whose reason
starts ``authorship:``, so the bus dead-letters the record with it, and counted by kind in
``refusals``):

* a sealed record is accepted only if its identity is enrolled and its seal is right: a
  node's MAC with the key of the current epoch (an older epoch: ``old_key``), a user's
  signature with the public key registered now; then its inner event is decoded as usual;
* an event that claims an author (:func:`claimed_author`: a node's NodeRegistered,
  NodeHeartbeat, Progress, CopyFinished; the user a JobSubmitted's job names; the user a
  JobCancelled names) is accepted only if sealed by that identity: an unsealed one, or one
  sealed by another identity, is refused;
* every other event is accepted sealed (checked as above) or not: its topic's ACL already
  names its one writer.

What it does not cover: a node may still lie about its *own* copies; the consumers check
those against the Assignment (the copy must be placed on that node) and the tracker screens
the replica (:mod:`shared.domain.replica_screen`). That a cancelling user owns the job is
checked by each consumer against the owner it knows (:mod:`shared.domain.ownership`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.bus.base import Bus
from shared.clock import Clock
from shared.errors import ConfigError
from shared.security.identities import (
    MASTER_KEY_BYTES,
    REGISTRY_ENV,
    Credential,
    Registry,
    RegistryFile,
    derive_key,
    read_master_key,
)
from shared.wire.events import (
    CopyFinished,
    Event,
    InvalidEvent,
    JobCancelled,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    decode,
)
from shared.wire.sealed import seal, unseal

__all__ = [
    "Sealer", "Verifier", "claimed_author", "authorship_from_env", "with_authorship", "sealer_from_env",
    "verifier_from_env", "IDENTITY_ENV", "KEY_ENV",
    "REGISTRY_ENV", "REFUSALS", "VERIFYING_PRINCIPALS",
]

IDENTITY_ENV = "HADAR_IDENTITY_FILE"            # a node's or user's credential: its bus seals what it publishes
KEY_ENV = "HADAR_AUTHORSHIP_KEY_FILE"           # the master key: a trusted service's bus checks nodes' seals

# Why a Verifier refused a record: not sealed though it claims an author; sealed by an
# identity not enrolled; with a key rotated away; a seal (MAC or signature) that does not
# match; by another identity than the one the event claims.
REFUSALS = ("unsealed", "not_enrolled", "old_key", "bad_seal", "other_author")
# The principals whose buses check nodes' seals: the trusted services that read the nodes'
# topics. Agents check users' seals only (they read hadar.jobs and hold no master key).
VERIFYING_PRINCIPALS = ("scheduler", "tracker", "profiler")
_NODE_EVENTS = (NodeRegistered, NodeHeartbeat, Progress, CopyFinished)


def claimed_author(event: Event) -> str | None:
    """Who alone may publish ``event``: a node (its node events), the user a job names (its
    JobSubmitted), the user a JobCancelled names (who must own the job: its consumers check);
    None if the topic's ACL suffices."""
    if isinstance(event, _NODE_EVENTS):
        return f"node/{event.node_id}"
    if isinstance(event, JobSubmitted):
        return f"user/{event.job.user}"
    if isinstance(event, JobCancelled):
        return f"user/{event.user}"   # "user/" when it names nobody: no identity is that
    return None


class Sealer:
    """Seals what one identity publishes: a node with its HMAC key, a user with its Ed25519 key."""

    def __init__(self, credential: Credential) -> None:
        self.identity = credential.identity
        self._epoch = credential.epoch
        self._key = credential.key
        self._signer = (Ed25519PrivateKey.from_private_bytes(credential.key)
                        if credential.identity.startswith("user/") else None)

    def __repr__(self) -> str:
        return f"Sealer({self.identity!r}, epoch={self._epoch})"

    def seal(self, inner: bytes) -> bytes:
        mac = self._signer.sign(inner) if self._signer is not None else hmac.digest(self._key, inner, "sha256")
        return seal(inner, by=self.identity, epoch=self._epoch, mac=mac)


class Verifier:
    """Opens records for a consumer; see the module guarantees. Without ``master`` (an
    agent) it checks users' seals only, and refuses a node's."""

    def __init__(self, master: bytes | None, registry: Callable[[], Registry]) -> None:
        if master is not None and len(master) != MASTER_KEY_BYTES:
            raise ValueError(f"master key: expected {MASTER_KEY_BYTES} bytes")
        self._master = master
        self._registry = registry
        self._keys: dict[tuple[str, int], bytes] = {}
        self._public: dict[tuple[str, bytes], Ed25519PublicKey] = {}
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
        registry = self._registry()
        current = registry.epochs.get(sealed.by)
        if current is None:
            raise self._refuse("not_enrolled", f"{sealed.by[:80]!r} is not enrolled (or was revoked)")
        # A user's seal is checked against the public key registered now (a rotated key's
        # signature fails), so a user may make a key pair before the admin enrols it.
        if sealed.epoch != current and not sealed.by.startswith("user/"):
            raise self._refuse("old_key", f"{sealed.by} sealed with key epoch {sealed.epoch}, "
                                          f"the current one is {current}")
        if not self._genuine(sealed.by, current, sealed.inner, sealed.mac, registry):
            raise self._refuse("bad_seal", f"bad seal on a record sealed as {sealed.by}")
        event = decode(sealed.inner)
        claim = claimed_author(event)
        if claim is not None and claim != sealed.by:
            raise self._refuse("other_author", f"{event.TYPE} for {claim} sealed by {sealed.by}")
        return event

    def _genuine(self, by: str, epoch: int, inner: bytes, mac: bytes, registry: Registry) -> bool:
        if len(self._keys) + len(self._public) > 65536:
            self._keys.clear()
            self._public.clear()
        if by.startswith("user/"):
            raw = registry.public_keys.get(by)
            if raw is None or len(mac) != 64:
                return False
            public = self._public.get((by, raw))
            if public is None:
                public = self._public[(by, raw)] = Ed25519PublicKey.from_public_bytes(raw)
            try:
                public.verify(mac, inner)
            except InvalidSignature:
                return False
            return True
        if self._master is None or len(mac) != 32:
            return False
        key = self._keys.get((by, epoch))
        if key is None:
            key = self._keys[(by, epoch)] = derive_key(self._master, by, epoch)
        return hmac.compare_digest(hmac.digest(key, inner, "sha256"), mac)


def authorship_from_env(env: Mapping[str, str], *, clock: Clock | None = None
                        ) -> tuple[Sealer | None, Verifier | None]:
    """The sealer (``HADAR_IDENTITY_FILE``) and the verifier (``HADAR_AUTHORSHIP_REGISTRY``,
    with ``HADAR_AUTHORSHIP_KEY_FILE`` to check nodes' seals too) the environment gives a
    process; each None if unset. A bad file is a :class:`ConfigError`."""
    return sealer_from_env(env), verifier_from_env(env, clock=clock)


def sealer_from_env(env: Mapping[str, str]) -> Sealer | None:
    """The sealer of the credential ``HADAR_IDENTITY_FILE`` names; None if unset."""
    identity = env.get(IDENTITY_ENV, "").strip()
    return Sealer(Credential.read(identity)) if identity else None


def verifier_from_env(env: Mapping[str, str], *, clock: Clock | None = None) -> Verifier | None:
    """The verifier ``HADAR_AUTHORSHIP_REGISTRY`` (and ``HADAR_AUTHORSHIP_KEY_FILE``) make; None if unset."""
    key, registry = (env.get(name, "").strip() for name in (KEY_ENV, REGISTRY_ENV))
    if key and not registry:
        raise ConfigError(f"{KEY_ENV} is given without {REGISTRY_ENV} (the verifier needs the registry)")
    return Verifier(read_master_key(key) if key else None, RegistryFile(registry, clock=clock)) if registry else None


def with_authorship(bus: Bus, env: Mapping[str, str]) -> Bus:
    """``bus`` sealing and verifying as ``env`` says (:func:`authorship_from_env`)."""
    bus.sealer, bus.verifier = authorship_from_env(env)
    return bus
