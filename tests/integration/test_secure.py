"""Least privilege on the real secured broker and MinIO (``hadar infra up --secure``).

Each principal can do what :mod:`shared.security.principals` grants and the broker or
MinIO refuses the rest: an agent cannot publish a ModelConsolidated, the CLI cannot read
with an agent's group, a node's agent cannot write a model nor another node's checkpoint
(nor read it) nor join another node's consumer group, a user writes only under their own
prefix, and a revoked or rotated node's old Kafka and store logins stop working; a wrong password or an untrusted CA
fails fast with one line naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import TopicAuthorizationFailedError
from minio import Minio
from minio.commonconfig import Tags
from minio.error import S3Error

from shared.bus import KafkaBus
from shared.bus.base import BusError
from shared.bus.kafka_login import diagnose, security_options
from shared.bus.settings import kafka_from_env
from shared.domain.layout import checkpoint_key
from shared.security.own_logins import own_login_env
from shared.security.principals import PRINCIPALS, SHARED_LOGINS
from shared.store import MinioStore, StoreDenied
from shared.store.settings import s3_from_env
from shared.wire.events import CopyWeight, JobCancelled, ModelConsolidated, encode
from shared.wire.topics import DEADLETTER, JOBS, MODELS

pytestmark = [pytest.mark.kafka, pytest.mark.s3]
ROOT = Path(__file__).resolve().parents[2]


def bus_of(env: dict[str, str], principal: str) -> KafkaBus:
    settings = kafka_from_env(env)
    assert settings is not None
    return KafkaBus.from_settings(settings, source=f"test-{principal}", request_timeout_ms=10_000)


def model_event() -> ModelConsolidated:
    return ModelConsolidated(job_id="secure-j", round=0, key="models/secure-j/0.safetensors", total_steps=1,
                             copies=(CopyWeight(copy=0, steps=1, weight=1.0),), ts=1.0, source="test")


async def test_each_principal_and_a_node_write_their_topics_and_the_dead_letters(secure_servers, tmp_path) -> None:
    node, user = node_env(secure_servers, "sec-w", tmp_path), own_login_env(secure_servers.env["cli"])
    for name, env in [*((n, secure_servers.env[n]) for n in SHARED_LOGINS), ("agent", node), ("cli", user)]:
        bus = bus_of(env, name)
        await bus.start()
        try:
            for topic in (*PRINCIPALS[name].writes, DEADLETTER):
                await bus.write_raw(topic, "k", b"allowed")
        finally:
            await bus.stop()


async def test_the_broker_refuses_a_model_published_with_a_nodes_credentials(secure_servers, tmp_path) -> None:
    node = node_env(secure_servers, "sec-m", tmp_path)
    security = kafka_from_env(node).security
    producer = AIOKafkaProducer(bootstrap_servers=node["HADAR_BOOTSTRAP"],
                                request_timeout_ms=10_000, **security_options(security))
    await producer.start()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.send_and_wait(MODELS, encode(model_event()), key=b"secure-j")
    finally:
        await producer.stop()
    bus = bus_of(node, "agent")
    await bus.start()
    try:
        with pytest.raises(BusError, match="TopicAuthorizationFailed") as refused:
            await bus.publish(model_event(), topic=MODELS, key="secure-j")
        assert not refused.value.retriable
    finally:
        await bus.stop()


async def test_the_cli_cannot_read_jobs_with_an_agent_group(secure_servers) -> None:
    bus = bus_of(own_login_env(secure_servers.env["cli"]), "cli")   # the local user's own login
    await bus.start()
    try:
        with pytest.raises(BusError, match="GroupAuthorizationFailed"):
            async with bus.subscribe(JOBS, "hadar-agent-node-a") as sub:
                async for _ in sub:
                    break
        await bus.write_raw(JOBS, "k", b"the cli may write jobs")
    finally:
        await bus.stop()


def identity_cli(secure_servers, *args: str) -> subprocess.CompletedProcess[str]:
    """``hadar identity ...`` as the admin, whose env names the store's root (so enrolling or
    revoking a node changes its store login at once)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **secure_servers.env["admin"]}
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "identity", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def own_env(secure_servers, kind: str, name: str, tmp_path: Path) -> dict[str, str]:
    """Enrol node or user ``name`` (or rotate its key) as the admin does, and return the env it
    runs with: its principal's (agent or cli), with its own Kafka and store logins from its
    credential."""
    admin = secure_servers.env["admin"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    credential = tmp_path / f"{name}.identity"
    done = identity_cli(secure_servers, "enrol", kind, name, "--master-key-file", admin["HADAR_AUTHORSHIP_KEY_FILE"],
                        "--registry", admin["HADAR_AUTHORSHIP_REGISTRY"], "--out", str(credential))
    for system in ("kafka", "store"):
        assert f"{system} login hadar-{kind}-{name}: created" in done.stdout, done.stdout
    principal = "agent" if kind == "node" else "cli"
    env = own_login_env({**secure_servers.env[principal], "HADAR_IDENTITY_FILE": str(credential)})
    assert env["HADAR_KAFKA_USERNAME"] == env["HADAR_S3_ACCESS_KEY"] == f"hadar-{kind}-{name}"
    return env


def node_env(secure_servers, node: str, tmp_path: Path) -> dict[str, str]:
    return own_env(secure_servers, "node", node, tmp_path)


def user_store(secure_servers, user: str, tmp_path: Path) -> MinioStore:
    """A store logged in as user ``user``'s hadar, enrolled as the admin does."""
    settings = s3_from_env(own_env(secure_servers, "user", user, tmp_path))
    assert settings is not None
    return MinioStore(settings)


def node_store(secure_servers, node: str, tmp_path: Path) -> MinioStore:
    settings = s3_from_env(node_env(secure_servers, node, tmp_path))
    assert settings is not None
    return MinioStore(settings)


async def kafka_login_refused(env: dict[str, str]) -> str | None:
    """Why the broker refuses ``env``'s login (None: it accepts it)."""
    settings = kafka_from_env(env)
    assert settings is not None
    return await diagnose(settings.bootstrap, settings.security, timeout_s=10.0)


async def denied(call: Awaitable[object]) -> str:
    with pytest.raises(StoreDenied) as refused:
        await call
    return refused.value.code


async def test_a_node_writes_its_own_checkpoints_and_nothing_another_node_or_the_tracker_owns(
        secure_servers, tmp_path: Path) -> None:
    assert "HADAR_S3_ACCESS_KEY" not in secure_servers.env["agent"]   # no login shared by every node
    long_id = "n" * 63   # the longest node id makes a MinIO user too
    one, two, longest = (node_store(secure_servers, n, tmp_path) for n in ("sec-n1", "sec-n2", long_id))
    for store in (one, two, longest):
        await store.start()   # a user that may not list the bucket's root still starts
    try:
        mine = checkpoint_key("secure-j", 0, 0, node="sec-n1")
        theirs = checkpoint_key("secure-j", 0, 1, node="sec-n2")
        await one.put(mine, b"w")
        await two.put(theirs, b"honest")
        await longest.put(checkpoint_key("secure-j", 0, 2, node=long_id), b"w")
        assert await one.get(mine) == b"w"
        # n1 cannot plant, overwrite, delete nor read what the tracker takes for n2's copy
        assert await denied(one.put(theirs, b"planted")) == "AccessDenied"
        assert await denied(one.put(checkpoint_key("secure-j", 0, 0, node="sec-n2"), b"planted")) == "AccessDenied"
        assert await denied(one.delete(theirs)) == "AccessDenied"
        assert await denied(one.get(theirs)) == "AccessDenied"
        assert await two.get(theirs) == b"honest"
        assert await denied(one.put("models/secure-j/0.safetensors", b"w")) == "AccessDenied"
        assert await denied(one.put("users/alice/code/" + "0" * 64 + ".tar", b"w")) == "AccessDenied"
    finally:
        for store in (one, two, longest):
            await store.stop()
    reader = user_store(secure_servers, "sec-reader", tmp_path)
    await reader.start()
    try:
        assert await denied(reader.get(mine)) == "AccessDenied"   # a user reads models, not replicas
    finally:
        await reader.stop()


async def test_a_user_writes_only_their_own_prefix_reads_models_and_loses_both_logins_when_revoked(
        secure_servers, tmp_path: Path) -> None:
    assert "HADAR_S3_ACCESS_KEY" not in secure_servers.env["cli"]   # no store login shared by every user
    alice, bob = user_store(secure_servers, "sec-alice", tmp_path), user_store(secure_servers, "sec-bob", tmp_path)
    root = s3_from_env(secure_servers.env["admin"])
    assert root is not None
    admin = MinioStore(root)
    for store in (alice, bob, admin):
        await store.start()
    try:
        pointer = "users/sec-bob/datasets/digits.json"
        await bob.put(pointer, b'{"digest": "honest"}')
        await alice.put("users/sec-alice/datasets/digits.json", b"{}")
        await admin.put("models/secure-u/0.safetensors", b"m", owner="sec-alice")
        assert await alice.get("models/secure-u/0.safetensors") == b"m"
        # alice can neither repoint bob's dataset name, nor plant a bundle under his prefix, nor read his
        assert await denied(alice.put(pointer, b'{"digest": "alices"}')) == "AccessDenied"
        assert await denied(alice.put("users/sec-bob/data/" + "0" * 64 + ".tar", b"x")) == "AccessDenied"
        assert await denied(alice.get(pointer)) == "AccessDenied"
        assert await denied(alice.put("models/secure-u/0.safetensors", b"x")) == "AccessDenied"
        assert await bob.get(pointer) == b'{"digest": "honest"}'
        bob_kafka = own_login_env({**secure_servers.env["cli"],
                                   "HADAR_IDENTITY_FILE": str(tmp_path / "sec-bob.identity")})
        assert await kafka_login_refused(bob_kafka) is None
        identity_cli(secure_servers, "revoke", "user", "sec-bob", "--registry",
                     secure_servers.env["admin"]["HADAR_AUTHORSHIP_REGISTRY"])
        assert await denied(bob.get(pointer)) == "InvalidAccessKeyId"   # a revoked user's logins are gone
        assert "wrong username or password" in (await kafka_login_refused(bob_kafka) or "")
    finally:
        for store in (alice, bob, admin):
            await store.stop()


async def test_a_user_reads_only_the_models_of_their_own_jobs_and_a_node_reads_any(
        secure_servers, tmp_path: Path) -> None:
    """The tracker tags each model with its job's user; a user's policy reads a model only
    when the tag names them, and grants no tagging, so no user can claim another's model."""
    tracker_settings = s3_from_env(secure_servers.env["tracker"])
    assert tracker_settings is not None
    tracker = MinioStore(tracker_settings)
    carol, dave = user_store(secure_servers, "own-carol", tmp_path), user_store(secure_servers, "own-dave", tmp_path)
    node = node_store(secure_servers, "own-n1", tmp_path)
    for store in (tracker, carol, dave, node):
        await store.start()
    carols, untagged = "models/own-j/0.safetensors", "models/own-j/1.safetensors"
    try:
        await tracker.put(carols, b"carol's weights", owner="own-carol")
        source = tmp_path / "final.bin"
        source.write_bytes(b"carol's final")
        await tracker.put_file("models/own-j/final.safetensors", source, owner="own-carol")
        await tracker.put(untagged, b"no owner")
        assert await carol.get(carols) == b"carol's weights"
        assert await carol.size("models/own-j/final.safetensors") == len(b"carol's final")
        await carol.get_file("models/own-j/final.safetensors", tmp_path / "got.bin")
        assert (tmp_path / "got.bin").read_bytes() == b"carol's final"
        for key in (carols, "models/own-j/final.safetensors", untagged):
            assert await denied(dave.get(key)) == "AccessDenied"
        assert await denied(carol.get(untagged)) == "AccessDenied"   # no owner: no user reads it
        assert await node.get(carols) == b"carol's weights" and await node.get(untagged) == b"no owner"
        dave_settings = dave.settings
        raw = Minio(dave_settings.host_port, access_key=dave_settings.access_key,
                    secret_key=dave_settings.secret_key, secure=dave_settings.secure)
        tags = Tags.new_object_tags()
        tags["owner"] = "own-dave"
        with pytest.raises(S3Error) as retag:   # dave cannot claim carol's model by re-tagging it
            await asyncio.to_thread(raw.set_object_tags, dave_settings.bucket, carols, tags)
        assert retag.value.code == "AccessDenied"
        assert await denied(dave.get(carols)) == "AccessDenied"
    finally:
        for store in (tracker, carol, dave, node):
            await store.stop()


async def test_a_revoked_or_rotated_nodes_old_store_login_stops_working(secure_servers, tmp_path: Path) -> None:
    """(The same for Kafka: test_a_revoked_or_rotated_nodes_old_kafka_login_stops_working.)"""
    admin = secure_servers.env["admin"]
    old = node_store(secure_servers, "sec-rot", tmp_path / "old")
    key = checkpoint_key("secure-r", 0, 0, node="sec-rot")
    await old.start()
    try:
        await old.put(key, b"w")
        new = node_store(secure_servers, "sec-rot", tmp_path / "new")   # a new epoch: a new secret
        await new.start()
        try:
            await new.put(key, b"w2")
            assert await denied(old.put(key, b"stale")) in ("InvalidAccessKeyId", "SignatureDoesNotMatch")
            done = identity_cli(secure_servers, "revoke", "node", "sec-rot", "--registry",
                                admin["HADAR_AUTHORSHIP_REGISTRY"])
            assert "store login hadar-node-sec-rot: removed" in done.stdout, done.stdout
            assert "kafka login hadar-node-sec-rot: removed" in done.stdout, done.stdout
            assert await denied(new.put(key, b"revoked")) == "InvalidAccessKeyId"
        finally:
            await new.stop()
    finally:
        await old.stop()


async def test_a_revoked_or_rotated_nodes_old_kafka_login_stops_working(secure_servers, tmp_path: Path) -> None:
    assert "HADAR_KAFKA_USERNAME" not in secure_servers.env["agent"]   # no login shared by every node
    shared = {**secure_servers.env["agent"], "HADAR_KAFKA_USERNAME": "agent", "HADAR_KAFKA_PASSWORD": "x" * 32}
    assert await kafka_login_refused(shared) is not None
    old = node_env(secure_servers, "sec-krot", tmp_path / "old")
    assert await kafka_login_refused(old) is None
    new = node_env(secure_servers, "sec-krot", tmp_path / "new")   # a new epoch: a new password
    assert await kafka_login_refused(new) is None
    assert "wrong username or password" in (await kafka_login_refused(old) or "")
    identity_cli(secure_servers, "revoke", "node", "sec-krot", "--registry",
                 secure_servers.env["admin"]["HADAR_AUTHORSHIP_REGISTRY"])
    assert "wrong username or password" in (await kafka_login_refused(new) or "")


async def test_a_node_may_not_read_with_another_nodes_group(secure_servers, tmp_path: Path) -> None:
    """Its own group works: every e2e agent reads with it (tests/e2e/test_secure_system.py)."""
    bus = bus_of(node_env(secure_servers, "sec-g1", tmp_path), "agent")
    await bus.start()
    try:
        for group in ("hadar-agent-sec-g2", "hadar-agent-sec-g10", "hadar-agent-sec-g1x"):
            with pytest.raises(BusError, match="GroupAuthorizationFailed"):
                async with bus.subscribe(JOBS, group) as sub:
                    async for _ in sub:
                        break
    finally:
        await bus.stop()


async def test_a_revoked_users_open_kafka_connection_is_cut_within_one_reauthentication_window(
        secure_servers, tmp_path: Path) -> None:
    """Revoking removes the login at once, but a connection made before lasts until the broker
    asks it to authenticate again: every connections.max.reauth.ms (devinfra.broker_auth.
    REAUTH_MS; the test broker's, ``secure_servers.reauth_ms``, is shorter). aiokafka cannot re-authenticate in place
    (KIP-368), so the broker closes the connection and the revoked login cannot open another."""
    env = own_env(secure_servers, "user", "sec-open", tmp_path)
    admin = bus_of(secure_servers.env["admin"], "admin")
    bus = bus_of(env, "cli")
    await bus.start()
    try:
        await bus.publish(JobCancelled(ts=1.0, source="cli", job_id="open-before", user="sec-open"))
        identity_cli(secure_servers, "revoke", "user", "sec-open", "--registry",
                     secure_servers.env["admin"]["HADAR_AUTHORSHIP_REGISTRY"])
        await asyncio.sleep(secure_servers.reauth_ms / 1000 + 1)
        with pytest.raises((TimeoutError, BusError)):
            await asyncio.wait_for(bus.publish(JobCancelled(ts=2.0, source="cli", job_id="open-after",
                                                            user="sec-open")), timeout=10)
    finally:
        with contextlib.suppress(TimeoutError, BusError):
            await asyncio.wait_for(bus.stop(), timeout=15)
    await admin.start()
    try:
        cancelled = [d.event.job_id async for d in admin.read(JOBS) if isinstance(d.event, JobCancelled)]
    finally:
        await admin.stop()
    assert "open-before" in cancelled and "open-after" not in cancelled


@pytest.mark.parametrize(("change", "named"), [
    ({"HADAR_KAFKA_PASSWORD": "not-the-password"}, "HADAR_KAFKA_USERNAME/HADAR_KAFKA_PASSWORD"),
    ({"HADAR_KAFKA_CA_FILE": ""}, "HADAR_KAFKA_CA_FILE"),
])
def test_a_wrong_password_or_an_untrusted_ca_fails_fast_with_one_line(secure_servers, change, named) -> None:
    if "HADAR_KAFKA_PASSWORD" in change:   # the user's own name, with a password given that is not theirs
        change = {**change, "HADAR_KAFKA_USERNAME": own_login_env(secure_servers.env["cli"])["HADAR_KAFKA_USERNAME"]}
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **secure_servers.env["cli"], **change}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "jobs"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.startswith("hadar jobs: error:")]
    assert done.returncode == 3, done.stderr
    assert len(lines) == 1 and named in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - began < 45   # no hang: bounded well below the client's retry loop
    assert not any(secret in done.stderr + done.stdout for secret in secure_servers.secrets)


def test_a_service_with_a_wrong_password_exits_with_one_log_line(secure_servers) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **secure_servers.env["profiler"],
           "HADAR_KAFKA_PASSWORD": "not-the-password"}
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "serve", "profiler", "--http-port", "0"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    output = done.stdout + done.stderr
    failed = [json.loads(line) for line in output.splitlines() if '"service.failed"' in line]
    assert len(failed) == 1 and failed[0]["error"].startswith("HADAR_KAFKA_USERNAME/HADAR_KAFKA_PASSWORD"), output
    assert "Traceback" not in output and "not-the-password" not in output


def test_no_secret_on_any_command_line(secure_servers) -> None:
    assert secure_servers.secrets
    assert not [pid for pid, line in command_lines().items() if any(s in line for s in secure_servers.secrets)]


def command_lines() -> dict[str, str]:
    found = {}
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found[path.parent.name] = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


async def test_credential_files_are_owner_only_and_complete(secure_servers) -> None:
    directory = secure_servers.paths.run / "credentials"
    assert directory.stat().st_mode & 0o077 == 0
    for name in PRINCIPALS:
        env_file = directory / f"{name}.env"
        assert env_file.stat().st_mode & 0o077 == 0
        # nodes and users share no login: each one's are in its credential (own_login_env)
        shared = name not in ("agent", "cli")
        assert secure_servers.env[name].get("HADAR_KAFKA_USERNAME") == (name if shared else None)
        assert (directory / f"{name}.kafka-password").exists() == shared
    await asyncio.sleep(0)


@pytest.mark.slow
def test_secure_init_from_docker_secret_files_rotates_a_password(secure_servers, tmp_path: Path) -> None:
    """The stack's init service path: ``hadar infra secure-init`` as admin, secrets from files."""
    env = secure_servers.env

    def secure_init(profiler_password: str) -> subprocess.CompletedProcess:
        secrets_dir = tmp_path / "run-secrets"
        secrets_dir.mkdir(exist_ok=True)
        for name in SHARED_LOGINS:
            password = profiler_password if name == "profiler" else env[name]["HADAR_KAFKA_PASSWORD"]
            (secrets_dir / f"kafka-{name}-password").write_text(password + "\n")
            if PRINCIPALS[name].uses_s3:
                (secrets_dir / f"s3-{name}-secret-key").write_text(env[name]["HADAR_S3_SECRET_KEY"] + "\n")
        return subprocess.run([sys.executable, "-m", "services.cli.main", "infra", "secure-init",
                               "--secrets-dir", str(secrets_dir)],
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env["admin"]},
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    old = env["profiler"]["HADAR_KAFKA_PASSWORD"]
    try:
        done = secure_init("rotated-" + old[:8])
        assert done.returncode == 0, done.stderr
        assert not any(secret in done.stdout + done.stderr for secret in secure_servers.secrets)
        assert "node and user kafka logins" in done.stderr and "node and user store logins" in done.stderr, done.stderr
        assert asyncio.run(diagnose_login(env["profiler"], "rotated-" + old[:8])) is None
        assert "HADAR_KAFKA_PASSWORD" in (asyncio.run(diagnose_login(env["profiler"], old)) or "")
    finally:
        assert secure_init(old).returncode == 0


async def diagnose_login(env: dict[str, str], password: str) -> str | None:
    """``None`` if ``password`` logs in as ``env``'s user, else the one-line reason.
    (secure-init returns only once every new credential logs in.)"""
    settings = kafka_from_env({**env, "HADAR_KAFKA_PASSWORD": password})
    assert settings is not None
    return await diagnose(settings.bootstrap, settings.security)
