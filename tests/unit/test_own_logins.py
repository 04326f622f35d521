"""A GPU node's own Kafka and store logins and a user's own store login (issue 26): derived
per identity and epoch, carried in the credential, and taken only when nothing else names a
login; and what a node's Kafka user may do (its ACLs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.security.files import write_private
from shared.security.identities import (
    Credential,
    enrol,
    kafka_password,
    new_master_key,
    read_master_key,
    store_secret,
)
from shared.security.own_logins import own_login_env
from shared.security.principals import (
    GROUP,
    LITERAL,
    PRINCIPALS,
    TOPIC,
    kafka_acls,
    node_kafka_acls,
    node_login,
    user_kafka_acls,
)

MASTER = bytes(range(32))


@pytest.fixture(autouse=True)
def _no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hadar identity enrol`` makes logins at once on the servers its env names: none here."""
    for name in ("HADAR_BOOTSTRAP", "HADAR_S3_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def test_a_nodes_login_secrets_differ_per_system_node_epoch_and_master() -> None:
    secrets = {derive(MASTER, i, e) for derive in (store_secret, kafka_password)
               for i, e in (("node/n1", 1), ("node/n2", 1), ("node/n1", 2))}
    secrets |= {store_secret(new_master_key(), "node/n1", 1)}
    assert len(secrets) == 7
    assert all(len(s) == 40 and int(s, 16) >= 0 for s in secrets)   # MinIO takes 8-40 characters
    assert store_secret(MASTER, "node/n1", 1) == store_secret(MASTER, "node/n1", 1)


def test_enrolling_a_node_gives_its_credential_the_login_of_its_epoch(tmp_path: Path) -> None:
    registry = tmp_path / "identities.json"
    first = enrol("node/n1", master=MASTER, registry_path=registry)
    second = enrol("node/n1", master=MASTER, registry_path=registry)
    assert first.store_secret == store_secret(MASTER, "node/n1", 1)
    assert (second.store_secret, second.kafka_password) == (store_secret(MASTER, "node/n1", 2),
                                                            kafka_password(MASTER, "node/n1", 2))
    assert Credential.from_text(second.to_text(), where="x") == second
    assert second.store_secret not in repr(second) and second.kafka_password not in repr(second)
    user = enrol("user/alice", master=None, registry_path=registry)
    assert user.store_secret == user.kafka_password == "" and "secret" not in user.to_text()   # no master


@pytest.mark.parametrize("field", ["store_secret", "kafka_password"])
@pytest.mark.parametrize("secret", ["short", "G" * 40, 7, "A" * 40])
def test_a_credential_with_a_malformed_login_is_refused(field: str, secret: object) -> None:
    text = Credential(identity="node/n1", epoch=1, key=bytes(32)).to_text()
    forged = text.rstrip("}\n") + f', "{field}": {secret!r}}}'.replace("'", '"')
    with pytest.raises(ConfigError, match="not a Hadar identity credential"):
        Credential.from_text(forged, where="x")


def _credential(tmp_path: Path, node: str, secret: str = "") -> Path:
    path = tmp_path / f"{node}.identity"
    write_private(path, Credential(identity=f"node/{node}", epoch=3, key=bytes(32), store_secret=secret,
                                   kafka_password=secret[::-1]).to_text())
    return path


SASL = {"HADAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "HADAR_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512"}


def test_an_agent_without_logins_takes_its_nodes_own(tmp_path: Path) -> None:
    secret = store_secret(MASTER, "node/n1", 3)
    env = {"HADAR_S3_ENDPOINT": "http://minio:9000", **SASL,
           "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", secret))}
    out = own_login_env(env)
    assert (out["HADAR_S3_ACCESS_KEY"], out["HADAR_S3_SECRET_KEY"]) == ("hadar-node-n1", secret)
    assert (out["HADAR_KAFKA_USERNAME"], out["HADAR_KAFKA_PASSWORD"]) == ("hadar-node-n1", secret[::-1])


def test_a_plaintext_broker_gets_no_kafka_login(tmp_path: Path) -> None:
    env = {"HADAR_S3_ENDPOINT": "http://m", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", "a" * 40))}
    assert "HADAR_KAFKA_USERNAME" not in own_login_env(env)


@pytest.mark.parametrize("given", [{"HADAR_S3_ACCESS_KEY": "root"}, {"HADAR_S3_ACCESS_KEY_FILE": "/run/k"}])
def test_a_login_named_in_the_environment_wins(tmp_path: Path, given: dict[str, str]) -> None:
    env = {"HADAR_S3_ENDPOINT": "http://m", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", "a" * 40)),
           **SASL, "HADAR_KAFKA_USERNAME": "agent", **given}
    assert own_login_env(env) == env


def test_no_endpoint_or_no_credential_leaves_the_environment_alone(tmp_path: Path) -> None:
    assert own_login_env({"HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", "a" * 40))}) == {
        "HADAR_IDENTITY_FILE": str(tmp_path / "n1.identity")}
    assert own_login_env({"HADAR_S3_ENDPOINT": "http://m"}) == {"HADAR_S3_ENDPOINT": "http://m"}


def test_a_credential_without_logins_is_a_config_error_when_one_is_needed(tmp_path: Path) -> None:
    env = {"HADAR_S3_ENDPOINT": "http://m", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1"))}
    with pytest.raises(ConfigError, match="carries no store login"):
        own_login_env(env)
    with pytest.raises(ConfigError, match="carries no Kafka login"):
        own_login_env({**SASL, "HADAR_IDENTITY_FILE": env["HADAR_IDENTITY_FILE"]})


def test_a_user_gets_their_own_store_login_and_a_kafka_login_named_in_the_env_wins(tmp_path: Path) -> None:
    path = tmp_path / "alice.identity"
    write_private(path, Credential(identity="user/alice", epoch=2, key=bytes(32), store_secret="b" * 40,
                                   kafka_password="c" * 40).to_text())
    env = {"HADAR_S3_ENDPOINT": "http://m", **SASL, "HADAR_KAFKA_USERNAME": "cli", "HADAR_IDENTITY_FILE": str(path)}
    out = own_login_env(env)
    assert (out["HADAR_S3_ACCESS_KEY"], out["HADAR_S3_SECRET_KEY"]) == ("hadar-user-alice", "b" * 40)
    assert out["HADAR_KAFKA_USERNAME"] == "cli"   # e.g. an operator's own: never replaced
    mine = own_login_env({k: v for k, v in env.items() if k != "HADAR_KAFKA_USERNAME"})
    assert (mine["HADAR_KAFKA_USERNAME"], mine["HADAR_KAFKA_PASSWORD"]) == ("hadar-user-alice", "c" * 40)
    registry = tmp_path / "identities.json"
    assert enrol("user/bob", master=MASTER, registry_path=registry).store_secret == store_secret(MASTER, "user/bob", 1)
    assert enrol("user/bob", master=MASTER, registry_path=registry).kafka_password == kafka_password(MASTER,
                                                                                                 "user/bob", 2)


def test_a_nodes_kafka_user_has_the_agents_topics_and_only_its_own_group() -> None:
    acls = node_kafka_acls("n1")
    assert {a.principal for a in acls} == {f"User:{node_login('n1')}"}
    topics = {(a.resource_name, a.operation) for a in acls if a.resource_type == TOPIC}
    assert topics == {(a.resource_name, a.operation) for a in kafka_acls(PRINCIPALS["agent"])
                      if a.resource_type == TOPIC}
    groups = [(a.resource_name, a.pattern_type) for a in acls if a.resource_type == GROUP]
    assert groups == [("hadar-agent-n1", LITERAL)]   # not a prefix: n1 may not join n10's group


def test_a_user_with_their_own_key_pair_gets_their_store_login_from_a_logins_file(tmp_path: Path, capsys) -> None:
    from services.cli.main import main
    registry, mine, logins, master = (tmp_path / n for n in ("r.json", "alice.identity", "alice.logins", "master"))
    assert main(["identity", "master-key", "--out", str(master)]) == 0
    assert main(["identity", "keygen", "user", "alice", "--out", str(mine)]) == 0
    public = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["identity", "enrol", "user", "alice", "--public-key", public, "--master-key-file", str(master),
                 "--registry", str(registry)]) == 2   # the logins file needs --out
    assert main(["identity", "enrol", "user", "alice", "--public-key", public, "--master-key-file", str(master),
                 "--registry", str(registry), "--out", str(logins)]) == 0
    assert "private" not in logins.read_text() and "key" not in json.loads(logins.read_text())   # no private half
    before = Credential.read(mine)
    assert main(["identity", "add-logins", "--credential", str(mine), "--logins", str(logins)]) == 0
    after = Credential.read(mine)
    assert after.key == before.key   # the private half never left alice
    assert after.store_secret == store_secret(read_master_key(master), "user/alice", 1)
    assert main(["identity", "keygen", "user", "bob", "--out", str(tmp_path / "bob.identity")]) == 0
    assert main(["identity", "add-logins", "--credential", str(tmp_path / "bob.identity"),
                 "--logins", str(logins)]) == 2   # alice's logins are not bob's


def test_a_users_kafka_user_has_the_cli_topics_and_no_group() -> None:
    acls = user_kafka_acls("alice")
    assert {a.principal for a in acls} == {"User:hadar-user-alice"}
    assert {(a.resource_name, a.operation) for a in acls} == {
        (a.resource_name, a.operation) for a in kafka_acls(PRINCIPALS["cli"])}
    assert not [a for a in acls if a.resource_type == GROUP]
    assert not PRINCIPALS["cli"].shared_login and not PRINCIPALS["agent"].shared_login
