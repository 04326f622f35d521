"""Sealed records and their verification (shared.wire.sealed, shared.security.authorship)."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cli.main import main
from shared.clock import FakeClock
from shared.errors import ConfigError
from shared.security.authorship import Sealer, Verifier, authorship_from_env, claimed_author
from shared.security.identities import Credential, Registry, RegistryFile, derive_key, new_user_key, public_key_of
from shared.wire.events import (
    CopyFinished,
    InvalidEvent,
    JobCancelled,
    JobSpec,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    ThroughputEstimate,
    encode,
)
from shared.wire.records import GpuInfo
from shared.wire.sealed import Sealed, open_unchecked, seal, unseal

MASTER = b"m" * 32


@pytest.fixture(autouse=True)
def _no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hadar identity enrol`` makes logins at once on the servers its env names: none here."""
    for name in ("HADAR_BOOTSTRAP", "HADAR_S3_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def cred(node: str, epoch: int = 1) -> Credential:
    return Credential(identity=f"node/{node}", epoch=epoch, key=derive_key(MASTER, f"node/{node}", epoch))


def heartbeat(node: str = "n1") -> NodeHeartbeat:
    return NodeHeartbeat(ts=1.0, source=f"agent/{node}", node_id=node, seq=3)


def verifier(**epochs: int) -> Verifier:
    registry = Registry(epochs={f"node/{k}": v for k, v in epochs.items()})
    return Verifier(MASTER, lambda: registry)


def test_a_sealed_record_opens_to_the_same_event_and_names_its_author() -> None:
    event = heartbeat()
    data = Sealer(cred("n1")).seal(encode(event))
    parts = unseal(data)
    assert parts is not None and parts.by == "node/n1" and parts.epoch == 1 and parts.inner == encode(event)
    assert verifier(n1=1).open(data) == event == open_unchecked(data)
    assert unseal(encode(event)) is None   # a plain envelope is not a sealed record


@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_changed_byte_of_a_sealed_record_is_refused(position: int, value: int) -> None:
    data = bytearray(Sealer(cred("n1")).seal(encode(heartbeat())))
    position %= len(data)
    if data[position] == value:
        return
    data[position] = value
    try:
        event = verifier(n1=1).open(bytes(data))
    except InvalidEvent:
        return
    # Only a change that leaves a valid plain or sealed record of another node's identity
    # could open; none exists for a node event: it must be sealed by n1 with n1's key.
    pytest.fail(f"opened a changed record: {event!r}")


@given(st.binary(max_size=300))
def test_unseal_returns_parts_none_or_invalid_event_for_any_bytes(tail: bytes) -> None:
    for data in (b"\x84" + tail, tail):
        try:
            result = unseal(data)
        except InvalidEvent:
            continue
        assert result is None or isinstance(result, Sealed)


def test_seal_refuses_what_unseal_would_refuse() -> None:
    with pytest.raises(ValueError):
        seal(b"x", by="node/n1", epoch=0, mac=b"0" * 32)
    with pytest.raises(ValueError):
        seal(b"x", by="node/n1", epoch=1, mac=b"short")
    with pytest.raises(ValueError):
        seal(b"x", by="n" * 201, epoch=1, mac=b"0" * 32)


def test_node_events_claim_their_node_user_events_their_user_and_others_nobody() -> None:
    gpu = GpuInfo(index=0, type="t4", memory_gb=16.0)
    assert claimed_author(NodeRegistered(ts=1.0, source="a", node_id="n2", gpus=(gpu,))) == "node/n2"
    assert claimed_author(heartbeat("n3")) == "node/n3"
    progress = Progress(ts=1.0, source="a", job_id="j", round=1, copy=0, node_id="n4", gpu_type="t4", workers=1,
                        steps_round=1, steps_total=1, samples_per_s=1.0, loss=1.0)
    assert claimed_author(progress) == "node/n4"
    finished = CopyFinished(ts=1.0, source="a", job_id="j", round=1, copy=0, node_id="n5", status="failed",
                            steps_round=1)
    assert claimed_author(finished) == "node/n5"
    assert claimed_author(JobCancelled(ts=1.0, source="cli", job_id="j", user="alice")) == "user/alice"
    assert claimed_author(JobCancelled(ts=1.0, source="cli", job_id="j")) == "user/"   # nobody is that
    assert claimed_author(ThroughputEstimate(ts=1.0, source="profiler", job_id="j", basis="estimate", workers=1,
                                             rates={"t4": 1.0})) is None


@pytest.mark.parametrize(("data", "reason"), [
    (encode(heartbeat("n1")), "NodeHeartbeat for node/n1 is not sealed"),
    (Sealer(cred("n2")).seal(encode(heartbeat("n1"))), "NodeHeartbeat for node/n1 sealed by node/n2"),
    (Sealer(cred("n1", epoch=2)).seal(encode(heartbeat("n1"))), "sealed with key epoch 2, the current one is 1"),
    (Sealer(cred("n9")).seal(encode(heartbeat("n9"))), "'node/n9' is not enrolled"),
    (Sealer(Credential(identity="node/n1", epoch=1, key=b"k" * 32)).seal(encode(heartbeat())), "bad seal"),
])
def test_each_refusal_says_why(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=r"^authorship: ") as refused:
        verifier(n1=1, n2=1).open(data)
    assert reason in refused.value.reason


def test_keys_differ_by_identity_epoch_and_master() -> None:
    keys = {derive_key(MASTER, "node/n1", 1), derive_key(MASTER, "node/n1", 2), derive_key(MASTER, "node/n2", 1),
            derive_key(b"x" * 32, "node/n1", 1), derive_key(MASTER, "node/n11", 1)}
    assert len(keys) == 5 and all(len(k) == 32 for k in keys)


def test_enrolling_again_rotates_and_a_revoked_epoch_is_never_reissued() -> None:
    registry, first = Registry().enrol("node/n1")
    registry, second = registry.enrol("node/n1")
    assert (first, second) == (1, 2)
    registry = registry.revoke("node/n1")
    assert "node/n1" not in registry.epochs and registry.retired["node/n1"] == 2
    registry, third = registry.enrol("node/n1")
    assert third == 3 and "node/n1" not in registry.retired
    assert Registry.from_text(registry.to_text(), where="r") == registry
    with pytest.raises(KeyError):
        Registry().revoke("node/n1")


@pytest.mark.parametrize("text", ["", "{}", '{"enrolled": {"node/n1": 0}}', '{"enrolled": []}',
                                  '{"enrolled": {"node/n1": "1"}}', "[1]"])
def test_a_malformed_registry_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="not a Hadar identity registry"):
        Registry.from_text(text, where="r")


def test_the_registry_file_is_read_again_when_it_changes(tmp_path) -> None:
    path, clock = tmp_path / "registry.json", FakeClock()
    path.write_text(Registry(epochs={"node/n1": 1}).to_text())
    source = RegistryFile(path, clock=clock, every_s=1.0)
    assert dict(source().epochs) == {"node/n1": 1}
    path.write_text(Registry(epochs={"node/n2": 4}).to_text())
    os.utime(path, ns=(1, 10**18))
    assert dict(source().epochs) == {"node/n1": 1}   # not checked again within a second
    clock.advance(1.0)
    assert dict(source().epochs) == {"node/n2": 4}
    path.write_text("not json")
    os.utime(path, ns=(1, 2 * 10**18))
    clock.advance(1.0)
    assert dict(source().epochs) == {"node/n2": 4} and "not a Hadar identity registry" in (source.error or "")


def test_the_environment_gives_a_sealer_a_verifier_or_a_clear_error(tmp_path) -> None:
    key, registry, credential = tmp_path / "master", tmp_path / "registry.json", tmp_path / "n1.json"
    key.write_text(MASTER.hex())
    registry.write_text(Registry(epochs={"node/n1": 1}).to_text())
    credential.write_text(cred("n1").to_text())
    assert authorship_from_env({}) == (None, None)
    sealer, checker = authorship_from_env({"HADAR_IDENTITY_FILE": str(credential),
                                           "HADAR_AUTHORSHIP_KEY_FILE": str(key),
                                           "HADAR_AUTHORSHIP_REGISTRY": str(registry)})
    assert sealer is not None and checker is not None
    event = heartbeat()
    assert checker.open(sealer.seal(encode(event))) == event == open_unchecked(sealer.seal(encode(event)))
    with pytest.raises(ConfigError, match="given without HADAR_AUTHORSHIP_REGISTRY"):
        authorship_from_env({"HADAR_AUTHORSHIP_KEY_FILE": str(key)})
    key.write_text("abcd")
    with pytest.raises(ConfigError, match="expected 32 bytes"):
        authorship_from_env({"HADAR_AUTHORSHIP_KEY_FILE": str(key), "HADAR_AUTHORSHIP_REGISTRY": str(registry)})
    key.write_text(MASTER.hex())
    with pytest.raises(ConfigError, match="no identity registry"):
        authorship_from_env({"HADAR_AUTHORSHIP_KEY_FILE": str(key), "HADAR_AUTHORSHIP_REGISTRY": str(tmp_path / "x")})
    credential.write_text("{}")
    with pytest.raises(ConfigError, match="not a Hadar identity credential"):
        authorship_from_env({"HADAR_IDENTITY_FILE": str(credential)})
    assert "key=" not in repr(cred("n1")) and str(cred("n1").key) not in repr(cred("n1"))


def test_the_identity_command_enrols_rotates_and_revokes(tmp_path, capsys) -> None:
    key, registry = tmp_path / "master", tmp_path / "registry.json"
    assert main(["identity", "master-key", "--out", str(key)]) == 0
    assert (key.stat().st_mode & 0o777) == 0o600
    assert main(["identity", "master-key", "--out", str(key)]) == 2   # never overwrites
    master = bytes.fromhex(key.read_text())
    for _ in range(2):
        assert main(["identity", "enrol", "node", "n1", "--master-key-file", str(key), "--registry", str(registry),
                     "--out", str(tmp_path / "n1.json")]) == 0
    issued = Credential.read(tmp_path / "n1.json")
    assert issued.identity == "node/n1" and issued.epoch == 2 and issued.key == derive_key(master, "node/n1", 2)
    checker, event = Verifier(master, lambda: Registry.read(registry)), heartbeat()
    assert checker.open(Sealer(issued).seal(encode(event))) == event
    assert main(["identity", "revoke", "node", "n1", "--registry", str(registry)]) == 0
    with pytest.raises(InvalidEvent, match="not enrolled"):
        checker.open(Sealer(issued).seal(encode(heartbeat())))
    assert main(["identity", "revoke", "node", "n1", "--registry", str(registry)]) == 2
    assert main(["identity", "enrol", "node", "bad/id", "--master-key-file", str(key), "--registry", str(registry),
                 "--out", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()


def user_cred(user: str, epoch: int = 1) -> Credential:
    return Credential(identity=f"user/{user}", epoch=epoch, key=new_user_key())


def submitted_by(user: str) -> JobSubmitted:
    spec = JobSpec(job_id="j1", user=user, model="resnet", dataset="digits", batch_size=8, workers=1, iterations=10)
    return JobSubmitted(ts=1.0, source="cli", job=spec, submitted_at=1.0)


def test_users_seal_with_ed25519_and_anyone_with_the_registry_checks_them() -> None:
    alice, bob = user_cred("alice"), user_cred("bob")
    registry = Registry()
    for c in (alice, bob):
        registry, _ = registry.enrol(c.identity, public_key_of(c.key))
    registry, _ = registry.enrol("node/n1")
    agent = Verifier(None, lambda: registry)            # an agent: the registry, no master key
    service = Verifier(MASTER, lambda: registry)
    mine = submitted_by("alice")
    for checker in (agent, service):
        assert checker.open(Sealer(alice).seal(encode(mine))) == mine
    cancel = JobCancelled(ts=2.0, source="cli", job_id="j1", user="alice")
    assert agent.open(Sealer(alice).seal(encode(cancel))) == cancel
    refused = {
        "other_author": [Sealer(bob).seal(encode(mine)),                                  # bob submits as alice
                         Sealer(bob).seal(encode(cancel)),                                # bob cancels as alice
                         Sealer(alice).seal(encode(JobCancelled(ts=2.0, source="cli", job_id="j1")))],  # no user
        "unsealed": [encode(mine), encode(cancel)],
        "bad_seal": [Sealer(Credential(identity="user/alice", epoch=1, key=bob.key)).seal(encode(mine)),
                     Sealer(cred("n1")).seal(encode(heartbeat("n1")))],                   # the agent cannot check nodes
    }
    for kind, records in refused.items():
        for data in records:
            with pytest.raises(InvalidEvent, match=r"^authorship: "):
                agent.open(data)
        assert agent.refusals[kind] == len(records), kind
    beat = heartbeat("n1")
    assert service.open(Sealer(cred("n1")).seal(encode(beat))) == beat


def test_a_user_is_enrolled_with_a_public_key_and_a_node_without() -> None:
    with pytest.raises(ValueError):
        Registry().enrol("user/alice")
    with pytest.raises(ValueError):
        Registry().enrol("node/n1", public_key_of(new_user_key()))
    registry, _ = Registry().enrol("user/alice", public_key_of(new_user_key()))
    assert Registry.from_text(registry.to_text(), where="r") == registry
    with pytest.raises(ConfigError):   # an enrolled user without its public key
        Registry.from_text('{"enrolled": {"user/alice": 1}}', where="r")


def test_the_identity_command_enrols_a_user_with_a_key_pair(tmp_path) -> None:
    registry = tmp_path / "registry.json"
    assert main(["identity", "enrol", "user", "alice", "--registry", str(registry),
                 "--out", str(tmp_path / "alice.json")]) == 0
    issued = Credential.read(tmp_path / "alice.json")
    assert issued.identity == "user/alice" and Registry.read(registry).public_keys["user/alice"] == public_key_of(
        issued.key)
    assert main(["identity", "enrol", "node", "n1", "--registry", str(registry),
                 "--out", str(tmp_path / "n1.json")]) == 2   # a node needs the master key
    assert main(["identity", "enrol", "user", "Alice", "--registry", str(registry),
                 "--out", str(tmp_path / "x.json")]) == 2


def test_hadar_submit_submits_as_the_credentials_user_and_refuses_another(monkeypatch) -> None:
    from services.cli.jobs import submitter
    from shared.errors import UsageError
    alice = Sealer(user_cred("alice"))
    assert submitter(alice, None) == submitter(alice, "") == submitter(alice, "alice") == "alice"
    with pytest.raises(UsageError, match="the job names user 'bob', but you are 'alice'"):
        submitter(alice, "bob")
    monkeypatch.setattr("getpass.getuser", lambda: "login")
    assert submitter(None, "bob") == "login"   # no credential: the job file's user (parse_job) or the login name


@given(st.sampled_from([encode(heartbeat("n1")), encode(submitted_by("alice"))]) | st.binary(max_size=400),
       st.sampled_from(["node/n1", "user/alice", "node/n9", "x"]), st.integers(0, 3),
       st.sampled_from([32, 64]).flatmap(lambda n: st.binary(min_size=n, max_size=n)) | st.binary(max_size=70))
def test_a_verifier_refuses_any_record_with_invalid_event_and_nothing_else(inner: bytes, by: str, epoch: int,
                                                                             mac: bytes) -> None:
    alice = public_key_of(b"a" * 32)
    registry = Registry(epochs={"node/n1": 1, "user/alice": 1}, public_keys={"user/alice": alice})
    checkers = (Verifier(MASTER, lambda: registry), Verifier(None, lambda: registry))
    framed = msgpack.packb({"sealed": inner, "by": by, "epoch": epoch, "mac": mac}, use_bin_type=True)
    for data in (framed, inner, b"\x84" + inner):
        for checker in checkers:
            try:
                checker.open(data)
            except InvalidEvent:
                pass


def test_a_user_makes_a_key_pair_and_the_admin_registers_only_its_public_half(tmp_path, capsys) -> None:
    registry, mine = tmp_path / "registry.json", tmp_path / "alice.identity"
    assert main(["identity", "keygen", "user", "alice", "--out", str(mine)]) == 0
    public = capsys.readouterr().out.strip()
    assert main(["identity", "keygen", "user", "alice", "--out", str(mine)]) == 2   # never overwrites
    for _ in range(2):   # enrolled twice: epoch 2, the user's credential says 1; the key is what counts
        assert main(["identity", "enrol", "user", "alice", "--public-key", public, "--registry", str(registry)]) == 0
    assert Registry.read(registry).epochs["user/alice"] == 2
    checker, event = Verifier(None, lambda: Registry.read(registry)), submitted_by("alice")
    assert checker.open(Sealer(Credential.read(mine)).seal(encode(event))) == event
    stale = Credential(identity="user/alice", epoch=2, key=new_user_key())   # a key rotated away
    with pytest.raises(InvalidEvent, match="bad seal"):
        checker.open(Sealer(stale).seal(encode(event)))
    assert main(["identity", "enrol", "user", "alice", "--public-key", "abc", "--registry", str(registry)]) == 2
    assert main(["identity", "enrol", "node", "n1", "--public-key", public, "--registry", str(registry)]) == 2
    assert main(["identity", "enrol", "user", "bob", "--registry", str(registry)]) == 2   # neither --out nor a key
