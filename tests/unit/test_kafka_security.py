"""Kafka security settings (flags > env > *_FILE, errors naming the setting) and the
principals table the ACLs and MinIO policies come from."""

from __future__ import annotations

import argparse
import hashlib
import ssl
from pathlib import Path

import pytest

from services.agent.config import AgentConfig
from services.agent.daemon.service import TOPICS as AGENT_TOPICS
from services.profiler.service import INPUT_TOPICS as PROFILER_TOPICS
from services.profiler.service import RECOVERY_TOPICS as PROFILER_RECOVERY
from services.profiler.service import ProfilerConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.live.inputs import INPUT_TOPICS as SCHEDULER_TOPICS
from services.scheduler.live.inputs import RECOVERY_TOPICS as SCHEDULER_RECOVERY
from services.tracker.config import TrackerConfig
from services.tracker.service import INPUT_TOPICS as TRACKER_TOPICS
from shared.bus import KafkaBus
from shared.bus.kafka_login import security_options
from shared.bus.settings import KafkaSecurity, KafkaSettings, kafka_from_env, kafka_security_from_env
from shared.errors import ConfigError
from shared.runtime.connection import add_bus_args, kafka_settings
from shared.security.principals import (
    ADMIN,
    PRINCIPALS,
    SERVICE_PRINCIPALS,
    kafka_acls,
    node_login,
    node_s3_policy,
    s3_policy,
    s3_user,
    user_login,
    user_s3_policy,
)
from shared.security.scram import salted_password
from shared.security.tls import make_tls
from shared.wire.topics import (
    ALL_TOPICS,
    DEADLETTER,
    JOBS,
    LEADERSHIP,
    MODELS,
    NODES,
    PLACEMENTS,
    PROGRESS,
    THROUGHPUT,
)

SASL = {"HADAR_BOOTSTRAP": "b:9093", "HADAR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "HADAR_KAFKA_USERNAME": "tracker", "HADAR_KAFKA_PASSWORD": "pw-env"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bus_args(parser)
    return parser.parse_args(argv)


def test_plaintext_is_the_default_and_needs_nothing() -> None:
    settings = kafka_from_env({"HADAR_BOOTSTRAP": "b:9092"})
    assert settings is not None and settings.security == KafkaSecurity()
    assert security_options(settings.security) == {"security_protocol": "PLAINTEXT"}


def test_sasl_settings_from_env_and_the_password_not_in_repr() -> None:
    settings = kafka_from_env({**SASL, "HADAR_KAFKA_SASL_MECHANISM": "scram-sha-256"})
    assert settings is not None
    sec = settings.security
    assert (sec.protocol, sec.mechanism, sec.username, sec.password) == ("SASL_SSL", "SCRAM-SHA-256", "tracker",
                                                                         "pw-env")
    assert "pw-env" not in repr(settings) and "pw-env" not in sec.describe()
    options = security_options(sec)
    assert options["sasl_plain_password"] == "pw-env" and isinstance(options["ssl_context"], ssl.SSLContext)


def test_password_and_username_from_docker_secret_files(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("pw-file\n")
    (tmp_path / "user").write_text("agent\n")
    env = {**SASL, "HADAR_KAFKA_PASSWORD": "", "HADAR_KAFKA_PASSWORD_FILE": str(tmp_path / "pw"),
           "HADAR_KAFKA_USERNAME": "", "HADAR_KAFKA_USERNAME_FILE": str(tmp_path / "user")}
    sec = kafka_security_from_env(env)
    assert (sec.username, sec.password) == ("agent", "pw-file")
    # The plain variable wins over its *_FILE in the environment...
    assert kafka_security_from_env({**env, "HADAR_KAFKA_PASSWORD": "pw-env"}).password == "pw-env"


def test_flags_win_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pw").write_text("pw-flag")
    for name, value in SASL.items():
        monkeypatch.setenv(name, value)
    settings = kafka_settings(parse(["--bootstrap", "f:1", "--kafka-username", "cli",
                                     "--kafka-password-file", str(tmp_path / "pw"),
                                     "--kafka-security-protocol", "SASL_PLAINTEXT"]))
    sec = settings.security
    # ...but a --kafka-password-file flag wins over $HADAR_KAFKA_PASSWORD.
    assert (settings.bootstrap, sec.protocol, sec.username, sec.password) == ("f:1", "SASL_PLAINTEXT", "cli",
                                                                              "pw-flag")
    assert kafka_settings(parse([])).security.password == "pw-env"


@pytest.mark.parametrize(("env", "named"), [
    ({"HADAR_KAFKA_SECURITY_PROTOCOL": "TLS"}, "HADAR_KAFKA_SECURITY_PROTOCOL"),
    ({**SASL, "HADAR_KAFKA_SASL_MECHANISM": "GSSAPI"}, "HADAR_KAFKA_SASL_MECHANISM"),
    ({**SASL, "HADAR_KAFKA_USERNAME": ""}, "HADAR_KAFKA_USERNAME"),
    ({**SASL, "HADAR_KAFKA_PASSWORD": ""}, "HADAR_KAFKA_PASSWORD"),
    ({**SASL, "HADAR_KAFKA_PASSWORD": "", "HADAR_KAFKA_PASSWORD_FILE": "/nonexistent/pw"},
     "HADAR_KAFKA_PASSWORD_FILE"),
    ({"HADAR_KAFKA_CA_FILE": "/ca.pem"}, "HADAR_KAFKA_CA_FILE"),
    ({**SASL, "HADAR_KAFKA_KEY_FILE": "/k.pem"}, "HADAR_KAFKA_KEY_FILE"),
])
def test_a_bad_setting_is_one_line_naming_it(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        kafka_from_env({"HADAR_BOOTSTRAP": "b:9092", **env})
    message = str(raised.value)
    assert message.startswith(named) and "\n" not in message
    assert "pw-env" not in message


def test_an_unreadable_ca_file_is_named_when_the_client_is_built(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate")
    for path in (tmp_path / "ca.pem", tmp_path / "missing.pem"):
        with pytest.raises(ConfigError, match=r"^HADAR_KAFKA_CA_FILE="):
            security_options(kafka_security_from_env({**SASL, "HADAR_KAFKA_CA_FILE": str(path)}))


def test_generated_certificate_verifies_for_loopback_and_carries_its_key(tmp_path: Path) -> None:
    import datetime as dt

    from cryptography import x509
    files = make_tls(tmp_path, hosts=("127.0.0.1", "kafka"), now=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    pem = files.server_pem.read_text()
    assert pem.startswith("-----BEGIN PRIVATE KEY-----") and pem.count("BEGIN CERTIFICATE") == 2
    assert files.server_pem.stat().st_mode & 0o077 == 0 and files.ca_key.stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificates(pem.encode())[0]
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["kafka"]
    context = ssl.create_default_context(cafile=str(files.ca_cert))   # loads as a trust store
    assert context.cert_store_stats()["x509_ca"] == 1


def test_salted_password_is_pbkdf2_of_the_mechanism_hash() -> None:
    # RFC 7914 section 11, PBKDF2-HMAC-SHA256("passwd", "salt", 1): first 32 bytes.
    assert salted_password("SCRAM-SHA-256", "passwd", b"salt", 1).hex() == (
        "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc")
    assert salted_password("SCRAM-SHA-512", "p", b"s", 4096) == hashlib.pbkdf2_hmac("sha512", b"p", b"s", 4096)


# ---------------------------------------------------------------- principals


def allowed(name: str, operation: int, resource_type: int = 2) -> set[str]:
    return {a.resource_name for a in kafka_acls(PRINCIPALS[name])
            if a.operation == operation and a.resource_type == resource_type}


def test_each_principal_writes_exactly_what_the_issue_table_says() -> None:
    writes = {"cli": {JOBS}, "agent": {NODES, PROGRESS}, "scheduler": {PLACEMENTS, LEADERSHIP},
              "tracker": {MODELS, LEADERSHIP}, "profiler": {THROUGHPUT}}
    assert set(SERVICE_PRINCIPALS) == set(writes)
    for name, topics in writes.items():
        assert allowed(name, 4) == topics | {DEADLETTER}, name
    assert kafka_acls(PRINCIPALS[ADMIN]) == []     # a super user, no bindings needed
    every = {a.resource_name for p in PRINCIPALS.values() for a in kafka_acls(p) if a.resource_type == 2}
    assert every <= set(ALL_TOPICS)


def test_each_service_reads_exactly_its_input_topics_with_its_own_group() -> None:
    # What each reads: subscribed inputs, and at start the topics it rebuilds its state from
    # (its own output included); only the scheduler follows the dead letters, to count
    # them once. A topic left out is not an error at the broker when it is
    # empty, so a first start works and the restart after it silently forgets its history.
    inputs = {"scheduler": {*SCHEDULER_TOPICS, *SCHEDULER_RECOVERY, DEADLETTER, LEADERSHIP},
              "tracker": {*TRACKER_TOPICS, LEADERSHIP},
              "profiler": {*PROFILER_TOPICS, *PROFILER_RECOVERY}, "agent": set(AGENT_TOPICS)}
    for name, topics in inputs.items():
        assert allowed(name, 3) == topics, name
    groups = {"scheduler": SchedulerConfig().group, "tracker": TrackerConfig().group,
              "profiler": ProfilerConfig().group, "agent": AgentConfig(node_id="n1").group}
    for name, group in groups.items():
        (prefix,) = allowed(name, 3, resource_type=3)
        assert group.startswith(prefix) and prefix == f"hadar-{name}", name
    assert not {a for a in kafka_acls(PRINCIPALS["cli"]) if a.resource_type == 3
                and "hadar-agent".startswith(a.resource_name)}
    # Only the scheduler and the tracker publish in transactions (their fenced publishers, ids
    # under their group's name).
    transactional = {n: allowed(n, 4, resource_type=5) for n in SERVICE_PRINCIPALS}
    assert transactional == {n: ({f"hadar-{n}"} if n in ("scheduler", "tracker") else set())
                             for n in SERVICE_PRINCIPALS}


def test_store_policies_follow_the_layout_prefixes() -> None:
    def actions(name: str, action: str) -> set[str]:
        policy = s3_policy(PRINCIPALS[name], "b")
        return {r.removeprefix("arn:aws:s3:::b/") for s in policy["Statement"] if action in s["Action"]
                for r in s["Resource"]}
    # GPU nodes share no store login: each node's own may write only its own checkpoints
    assert not PRINCIPALS["agent"].uses_s3
    def node_actions(action: str) -> set[str]:
        return {r.removeprefix("arn:aws:s3:::b/") for st in node_s3_policy("n1", "b")["Statement"]
                if action in st["Action"] for r in st["Resource"]}
    own = "checkpoints/*/*/n1/*"
    assert node_actions("s3:PutObject") == node_actions("s3:DeleteObject") == {own}
    assert node_actions("s3:GetObject") == {own, "models/*", "users/*"}   # users' bundles
    assert node_login("n1") == "hadar-node-n1"
    own_tracker = {"checkpoints/*", "models/*", "snapshots/hadar-tracker*"}   # and its own state snapshots
    assert actions("tracker", "s3:PutObject") == own_tracker and actions("tracker", "s3:GetObject") == own_tracker
    # users share no store login either: each one's own reads models and read+writes only its own prefix
    assert not PRINCIPALS["cli"].uses_s3
    user = {a: {r.removeprefix("arn:aws:s3:::b/") for st in user_s3_policy("alice", "b")["Statement"]
                if a in st["Action"] for r in st["Resource"]} for a in ("s3:GetObject", "s3:PutObject")}
    assert user == {"s3:GetObject": {"models/*", "users/alice/*"}, "s3:PutObject": {"users/alice/*"}}
    # ... and of models only those tagged as hers: the tracker tags a job's models with its user
    (models,) = [st for st in user_s3_policy("alice", "b")["Statement"] if "arn:aws:s3:::b/models/*" in st["Resource"]]
    assert models["Condition"] == {"StringEquals": {"s3:ExistingObjectTag/owner": ["alice"]}}
    assert not any("s3:PutObjectTagging" in st["Action"] for st in user_s3_policy("alice", "b")["Statement"])
    assert user_login("alice") == "hadar-user-alice"
    for service in ("scheduler", "profiler"):   # their own state snapshots, nothing else
        own = {f"snapshots/hadar-{service}*"}
        assert actions(service, "s3:GetObject") == own and actions(service, "s3:PutObject") == own
    assert s3_user(PRINCIPALS["tracker"]) == "hadar-tracker"


def test_a_bootstrap_list_of_several_brokers_reaches_every_client_as_given() -> None:
    # `hadar infra up --brokers 3` writes HADAR_BOOTSTRAP with all three brokers.
    listed = "127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094"
    settings = kafka_from_env({"HADAR_BOOTSTRAP": listed})
    assert settings is not None and settings.bootstrap == listed
    parser = argparse.ArgumentParser()
    add_bus_args(parser)
    assert kafka_settings(parser.parse_args(["--bootstrap", listed])).bootstrap == listed
    assert KafkaBus.from_settings(settings, source="scheduler").client_options("g")["bootstrap_servers"] == listed
    with pytest.raises(ConfigError, match=r"host:port\[,host:port\.\.\.\]"):
        KafkaSettings(bootstrap="127.0.0.1:9092,broker-without-port")
