"""A GPU node's own store login (issue 26): derived per node and epoch, carried in the node's
credential, and taken by the agent only when nothing else names a login."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.agent.cli import node_store_env
from shared.errors import ConfigError, UsageError
from shared.security.files import write_private
from shared.security.identities import Credential, enrol, new_master_key, store_secret

MASTER = bytes(range(32))


def test_a_nodes_store_secret_differs_per_node_epoch_and_master() -> None:
    secrets = {store_secret(MASTER, "node/n1", 1), store_secret(MASTER, "node/n2", 1),
               store_secret(MASTER, "node/n1", 2), store_secret(new_master_key(), "node/n1", 1)}
    assert len(secrets) == 4
    assert all(len(s) == 40 and int(s, 16) >= 0 for s in secrets)   # MinIO takes 8-40 characters
    assert store_secret(MASTER, "node/n1", 1) == store_secret(MASTER, "node/n1", 1)


def test_enrolling_a_node_gives_its_credential_the_login_of_its_epoch(tmp_path: Path) -> None:
    registry = tmp_path / "identities.json"
    first = enrol("node/n1", master=MASTER, registry_path=registry)
    second = enrol("node/n1", master=MASTER, registry_path=registry)
    assert first.store_secret == store_secret(MASTER, "node/n1", 1)
    assert second.store_secret == store_secret(MASTER, "node/n1", 2)
    assert Credential.from_text(second.to_text(), where="x") == second
    assert second.store_secret not in repr(second)
    user = enrol("user/alice", master=None, registry_path=registry)
    assert user.store_secret == "" and "store_secret" not in user.to_text()


@pytest.mark.parametrize("secret", ["short", "G" * 40, 7, "A" * 40])
def test_a_credential_with_a_malformed_store_login_is_refused(secret: object) -> None:
    text = Credential(identity="node/n1", epoch=1, key=bytes(32)).to_text()
    forged = text.rstrip("}\n") + f', "store_secret": {secret!r}}}'.replace("'", '"')
    with pytest.raises(ConfigError, match="not a Hadar identity credential"):
        Credential.from_text(forged, where="x")


def _credential(tmp_path: Path, node: str, secret: str = "") -> Path:
    path = tmp_path / f"{node}.identity"
    write_private(path, Credential(identity=f"node/{node}", epoch=3, key=bytes(32), store_secret=secret).to_text())
    return path


def test_an_agent_without_a_store_login_takes_its_nodes_own(tmp_path: Path) -> None:
    secret = store_secret(MASTER, "node/n1", 3)
    env = {"HADAR_S3_ENDPOINT": "http://minio:9000", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", secret))}
    out = node_store_env(env, "n1")
    assert (out["HADAR_S3_ACCESS_KEY"], out["HADAR_S3_SECRET_KEY"]) == ("hadar-node-n1", secret)


@pytest.mark.parametrize("given", [{"HADAR_S3_ACCESS_KEY": "root"}, {"HADAR_S3_ACCESS_KEY_FILE": "/run/k"}])
def test_a_login_named_in_the_environment_wins(tmp_path: Path, given: dict[str, str]) -> None:
    env = {"HADAR_S3_ENDPOINT": "http://m", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", "a" * 40)),
           **given}
    assert node_store_env(env, "n1") == env


def test_no_endpoint_or_no_credential_leaves_the_environment_alone(tmp_path: Path) -> None:
    assert node_store_env({"HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n1", "a" * 40))}, "n1") == {
        "HADAR_IDENTITY_FILE": str(tmp_path / "n1.identity")}
    assert node_store_env({"HADAR_S3_ENDPOINT": "http://m"}, "n1") == {"HADAR_S3_ENDPOINT": "http://m"}


def test_another_nodes_credential_or_one_without_a_login_is_a_usage_error(tmp_path: Path) -> None:
    env = {"HADAR_S3_ENDPOINT": "http://m", "HADAR_IDENTITY_FILE": str(_credential(tmp_path, "n2", "a" * 40))}
    with pytest.raises(UsageError, match="node/n2"):
        node_store_env(env, "n1")
    env["HADAR_IDENTITY_FILE"] = str(_credential(tmp_path, "n1"))
    with pytest.raises(UsageError, match="carries no store login"):
        node_store_env(env, "n1")
