"""The swarm stack validates, runs commands the CLI has, and sets only env vars we read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cli.main import build_parser
from tests.required import unavailable

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "deploy" / "stack.yml"
STACK_HA = ROOT / "deploy" / "stack-ha.yml"
HADAR_SERVICES = ("scheduler", "tracker", "profiler", "agent")
IMAGE = "registry.example.internal/hadar:1.2.3@sha256:" + "ab" * 32
CLUSTER_ID = "MkU3OEVBNTcwNTJENDM2Qk"


def _stack(stack: Path = STACK, **extra_env: str) -> dict:
    docker = shutil.which("docker")
    if docker is None:
        unavailable(f"the docker client is needed to validate deploy/{stack.name}")
    env = {**os.environ, "HADAR_IMAGE": IMAGE, **extra_env}
    out = subprocess.run([docker, "stack", "config", "-c", str(stack)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_stack_validates_with_the_docker_client():
    config = _stack()
    assert set(HADAR_SERVICES) | {"kafka", "minio"} <= set(config["services"])
    assert config["services"]["agent"]["deploy"]["mode"] == "global"
    assert "healthcheck" in config["services"]["scheduler"]


def _load(stack: Path) -> dict:
    return _stack(stack, HADAR_KAFKA_CLUSTER_ID=CLUSTER_ID) if stack == STACK_HA else _stack(stack)


@pytest.mark.parametrize("stack", (STACK, STACK_HA), ids=lambda p: p.name)
@pytest.mark.parametrize("service", HADAR_SERVICES)
def test_each_service_command_is_a_cli_command(service, stack, monkeypatch):
    command = _load(stack)["services"][service]["command"]
    monkeypatch.setenv("HADAR_NODE_ID", "node-a")
    args = build_parser().parse_args(command)   # argparse exits (SystemExit) on anything unknown
    assert args.command == "serve" and args.service == service


def _env_vars_read_by_code() -> set[str]:
    names: set[str] = set()
    for path in list((ROOT / "shared").rglob("*.py")) + list((ROOT / "services").rglob("*.py")):
        names |= set(re.findall(r"[\"'](HADAR_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    # and each service's config fields, read as {prefix}{FIELD} (shared/runtime/config.py)
    import dataclasses

    from services.agent.cli import ENV_PREFIX
    from services.agent.config import AgentConfig
    from shared.runtime.config import env_name
    names |= {env_name(f, ENV_PREFIX) for f in dataclasses.fields(AgentConfig)}
    return names


@pytest.mark.parametrize("stack", (STACK, STACK_HA), ids=lambda p: p.name)
def test_every_env_var_the_stack_sets_is_read_by_the_services(stack):
    read = _env_vars_read_by_code()
    config = _load(stack)
    for service in (*HADAR_SERVICES, "secure-init"):
        env = config["services"][service].get("environment", {})
        unknown = sorted(set(env) - read)
        assert not unknown, f"{service} sets env vars no service reads: {unknown}"


# ---------------------------------------------------------------- issue 15 / issue 17 item 6


def test_the_image_has_no_default_and_keeps_its_digest():
    config = _stack()
    assert {config["services"][s]["image"] for s in (*HADAR_SERVICES, "secure-init")} == {IMAGE}
    docker = shutil.which("docker")
    env = {k: v for k, v in os.environ.items() if k != "HADAR_IMAGE"}
    out = subprocess.run([docker, "stack", "config", "-c", str(STACK)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode != 0 and "HADAR_IMAGE" in out.stderr


def test_each_service_logs_in_as_its_own_principal_with_secrets_from_files():
    from shared.security.authorship import VERIFYING_PRINCIPALS
    from shared.security.principals import NODE_PRINCIPAL, PRINCIPALS, s3_user
    config = _stack()
    for service in HADAR_SERVICES:
        spec = config["services"][service]
        env = spec["environment"]
        principal = PRINCIPALS[service]
        assert env["HADAR_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["HADAR_BOOTSTRAP"] == "kafka:9094"
        mounted = {s["target"]: s["source"] for s in spec["secrets"]}
        wanted = {"kafka-ca": "hadar_kafka_ca"}
        if principal.shared_login:
            assert env["HADAR_KAFKA_USERNAME"] == service
            assert env["HADAR_KAFKA_PASSWORD_FILE"] == f"/run/secrets/kafka-{service}-password"
            wanted[f"kafka-{service}-password"] = f"hadar_kafka_{service}_password"
        else:   # each node logs in as itself, with the logins in its credential (node_login_env)
            assert not any(name.startswith("HADAR_KAFKA_USERNAME") or "PASSWORD" in name for name in env), service
            assert env["HADAR_IDENTITY_FILE"].startswith("/etc/hadar/identity/")
        if principal.uses_s3:
            assert env["HADAR_S3_ACCESS_KEY"] == s3_user(principal)
            assert env["HADAR_S3_SECRET_KEY_FILE"] == f"/run/secrets/s3-{service}-secret-key"
            wanted[f"s3-{service}-secret-key"] = f"hadar_s3_{service}_secret_key"
        else:
            assert not any(name.startswith(("HADAR_S3_ACCESS", "HADAR_S3_SECRET")) for name in env)
        if service in VERIFYING_PRINCIPALS:   # they check who wrote each node's records; agents never can
            wanted |= {"authorship-master-key": "hadar_authorship_master_key",
                       "identity-registry": "hadar_identity_registry"}
            assert env["HADAR_AUTHORSHIP_KEY_FILE"] == "/run/secrets/authorship-master-key"
            assert env["HADAR_AUTHORSHIP_REGISTRY"] == "/run/secrets/identity-registry"
        else:   # an agent checks users' seals (the registry, no secret), never a node's (no master key)
            wanted["identity-registry"] = "hadar_identity_registry"
            assert env["HADAR_AUTHORSHIP_REGISTRY"] == "/run/secrets/identity-registry"
            assert "HADAR_AUTHORSHIP_KEY_FILE" not in env, service
        assert mounted == wanted, service   # no service holds another's secret, none the root's
        # s3_from_env refuses an endpoint without credentials: a service given the endpoint
        # must be given its keys too, or it exits at start -- except an agent, whose store login is
        # its node's own, in its credential (services/agent/cli.py node_login_env).
        assert ("HADAR_S3_ENDPOINT" not in env) or principal.uses_s3 or service == NODE_PRINCIPAL, service
        assert not any("PASSWORD" in n and not n.endswith("_FILE") for n in env), service


def test_each_agent_seals_with_its_own_nodes_credential_from_the_nodes_disk():
    for config in (_stack(), _ha()):
        agent = config["services"]["agent"]
        credential = agent["environment"]["HADAR_IDENTITY_FILE"]
        binds = [v for v in agent["volumes"] if v["type"] == "bind"]
        assert [(v["target"], v.get("read_only")) for v in binds] == [(os.path.dirname(credential), True)]
        assert not any(s["source"].startswith("hadar_authorship") for s in agent["secrets"])


def test_secure_init_runs_our_cli_as_admin_with_every_principals_secret():
    from services.cli.secure_init import read_secrets
    from shared.security.principals import SERVICE_PRINCIPALS
    config = _stack()
    init = config["services"]["secure-init"]
    args = build_parser().parse_args(init["command"])
    assert (args.command, args.action, str(args.secrets_dir)) == ("infra", "secure-init", "/run/secrets")
    assert init["environment"]["HADAR_KAFKA_USERNAME"] == "admin"
    targets = {s["target"] for s in init["secrets"]}
    for name in SERVICE_PRINCIPALS:
        assert (f"kafka-{name}-password" in targets) == (name not in ("agent", "cli"))
    # read_secrets reads exactly the files the stack mounts (a missing one is a one-line error)
    import tempfile
    from pathlib import Path as P
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            (P(tmp) / target).write_text("x\n")
        kafka, s3 = read_secrets(P(tmp))
    assert set(kafka) == set(SERVICE_PRINCIPALS) - {"agent", "cli"} and set(s3) == {"tracker", "scheduler", "profiler"}
    # no login shared by the agents: secure-init derives each enrolled node's own from these
    assert {"authorship-master-key", "identity-registry"} <= targets
    assert init["environment"]["HADAR_AUTHORSHIP_KEY_FILE"] == "/run/secrets/authorship-master-key"
    assert init["environment"]["HADAR_AUTHORSHIP_REGISTRY"] == "/run/secrets/identity-registry"
    assert set(config["secrets"]) >= {s["source"] for svc in config["services"].values()
                                      for s in svc.get("secrets", [])}


def test_the_stack_is_hardened():
    config = _stack()
    assert config["networks"]["hadar"]["driver_opts"]["encrypted"] == "true"
    kafka = config["services"]["kafka"]
    assert "9094" in " ".join(kafka["healthcheck"]["test"])
    assert kafka["environment"]["KAFKA_HEAP_OPTS"] == "-Xms1g -Xmx1g"
    for name in ("kafka", "tracker", "scheduler", "profiler", "minio"):
        deploy = config["services"][name]["deploy"]
        assert {"limits", "reservations"} <= set(deploy["resources"]), name
        assert deploy["update_config"]["failure_action"] == "rollback" and "rollback_config" in deploy, name
    for name, spec in config["services"].items():
        assert spec["logging"]["options"].keys() >= {"max-size", "max-file"}, name
        constraints = spec["deploy"]["placement"]["constraints"]
        gpu = "node.labels.hadar.gpu == true" if name == "agent" else "node.labels.hadar.gpu != true"
        assert gpu in constraints, name
    scheduler = config["services"]["scheduler"]
    flags = build_parser().parse_args(scheduler["command"])
    assert flags.standby and scheduler["deploy"]["replicas"] == 2   # one active, one standby (issue 28)
    assert scheduler["deploy"]["placement"]["max_replicas_per_node"] == 1   # never both on one machine
    tracker = config["services"]["tracker"]
    staging = build_parser().parse_args(tracker["command"]).temp_dir
    assert any(v["target"] == staging and v["type"] == "volume" for v in tracker["volumes"])
    agent = config["services"]["agent"]["deploy"]["resources"]["reservations"]
    assert agent["generic_resources"][0]["discrete_resource_spec"]["kind"] == "NVIDIA-GPU"


@pytest.mark.parametrize("stack", (STACK, STACK_HA), ids=lambda p: p.name)
def test_the_healthcheck_probes_the_port_the_services_listen_on(stack, monkeypatch):
    config = _load(stack)
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ENV" in dockerfile and "HADAR_HTTP_PORT=8080" in dockerfile
    assert "os.environ.get('HADAR_HTTP_PORT', '8080')" in dockerfile
    for service in HADAR_SERVICES:
        spec = config["services"][service]
        assert "HADAR_HTTP_PORT" in " ".join(spec["healthcheck"]["test"])
        for name, value in spec["environment"].items():
            monkeypatch.setenv(name, value)
        args = build_parser().parse_args(spec["command"])
        assert (args.http_host, args.http_port) == ("0.0.0.0", int(spec["environment"]["HADAR_HTTP_PORT"]))


# ---------------------------------------------------------------- issue 28: stack-ha.yml

KAFKA_NODES = ("kafka-1", "kafka-2", "kafka-3")


def _ha() -> dict:
    return _load(STACK_HA)


def _label(constraints: list[str], name: str) -> str:
    """The value the one ``node.labels.<name> == X`` constraint pins to."""
    found = [c.split("==")[1].strip() for c in constraints if c.replace(" ", "").startswith(f"node.labels.{name}==")]
    assert len(found) == 1, constraints
    return found[0]


def _properties(script: Path) -> dict[str, str]:
    """The ``key=value`` lines of the server.properties an entrypoint writes (its heredoc)."""
    text = script.read_text()
    body = text.split("<<PROPERTIES\n", 1)[1].split("\nPROPERTIES\n", 1)[0]
    return dict(line.split("=", 1) for line in body.splitlines() if "=" in line)


def _expand(endpoint: str) -> list[str]:
    """MinIO's ``{a...b}`` ellipsis, as ``minio server`` expands it."""
    match = re.search(r"\{(\d+)\.\.\.(\d+)\}", endpoint)
    if match is None:
        return [endpoint]
    return [endpoint[:match.start()] + str(n) + endpoint[match.end():]
            for n in range(int(match[1]), int(match[2]) + 1)]


def test_ha_stack_validates_and_needs_an_image_and_a_cluster_id():
    config = _ha()
    assert {*HADAR_SERVICES, *KAFKA_NODES, "minio", "topics", "secure-init"} <= set(config["services"])
    docker = shutil.which("docker")
    given = {"HADAR_IMAGE": IMAGE, "HADAR_KAFKA_CLUSTER_ID": CLUSTER_ID}
    for missing in given:
        env = {k: v for k, v in os.environ.items() if k not in given}
        env.update({k: v for k, v in given.items() if k != missing})
        out = subprocess.run([docker, "stack", "config", "-c", str(STACK_HA)], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode != 0 and missing in out.stderr, missing


def test_ha_kafka_runs_three_nodes_on_three_machines_with_their_own_volumes():
    services = _ha()["services"]
    labels, volumes, ids = set(), set(), set()
    for name in KAFKA_NODES:
        spec = services[name]
        labels.add(_label(spec["deploy"]["placement"]["constraints"], "hadar.kafka"))
        deploy = spec["deploy"]
        assert deploy["replicas"] == 1 and "node.labels.hadar.gpu != true" in deploy["placement"]["constraints"]
        [volume] = spec["volumes"]
        assert volume["type"] == "volume" and volume["target"] == "/var/lib/kafka/data"
        volumes.add(volume["source"])
        env = spec["environment"]
        ids.add(env["KAFKA_NODE_ID"])
        assert env["KAFKA_ADVERTISED_HOST"] == spec["hostname"] == name
        assert env["CLUSTER_ID"] == CLUSTER_ID and env["KAFKA_QUORUM"] == "static"
        assert sorted(env["KAFKA_QUORUM_VOTERS"].split(",")) == [f"{n[-1]}@{n}:9093" for n in KAFKA_NODES]
        assert spec["entrypoint"] == ["/bin/bash", "/hadar/secure-entrypoint-ha.sh"]
        assert "9094" in " ".join(spec["healthcheck"]["test"])
    assert len(labels) == len(volumes) == len(ids) == 3   # no two nodes share a machine, a disk or an id
    assert ids == {n[-1] for n in KAFKA_NODES}


def test_ha_entrypoint_replicates_every_topic_as_the_dev_cluster_does():
    from devinfra.kafka_config import replication_properties
    config = _ha()
    script = Path(config["configs"]["hadar_kafka_ha_entrypoint"]["file"])
    assert script.resolve() == (ROOT / "deploy" / "kafka" / "secure-entrypoint-ha.sh").resolve()
    ha = _properties(script)
    for key, value in replication_properties(3).items():   # RF 3, min ISR 2, offsets, transactions
        assert ha.get(key) == value, key
    assert ha["default.replication.factor"] == "3" and ha["min.insync.replicas"] == "2"
    # Controllers talk across machines: mutual TLS, and no anonymous super user.
    assert "CONTROLLER:SSL" in ha["listener.security.protocol.map"].split(",")
    assert ha["listener.name.controller.ssl.client.auth"] == "required"
    assert "ANONYMOUS" not in ha["super.users"] and "User:admin" in ha["super.users"].split(";")
    # Everything else the clients see is the single node's (deploy/kafka/secure-entrypoint.sh).
    single = _properties(ROOT / "deploy" / "kafka" / "secure-entrypoint.sh")
    differs = {"node.id", "controller.quorum.voters", "listeners", "advertised.listeners",
               "listener.security.protocol.map", "super.users", *replication_properties(3)}
    assert {k: v for k, v in single.items() if k not in differs} == {
        k: v for k, v in ha.items() if k in single and k not in differs}
    assert set(single) - set(ha) == {"controller.quorum.voters"}   # written from KAFKA_QUORUM instead
    # A revoked login's open connection is cut within the same window as the dev broker's.
    from devinfra.broker_auth import REAUTH_MS
    assert single["connections.max.reauth.ms"] == ha["connections.max.reauth.ms"] == str(REAUTH_MS)
    bash = shutil.which("bash")
    if bash is not None:
        out = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr


def test_ha_topics_are_created_with_three_replicas_and_the_retention_policy():
    from shared.wire.retention import config_string
    from shared.wire.topics import ALL_TOPICS
    services = _ha()["services"]
    script = " ".join(services["topics"]["command"])
    assert "bs=kafka-1:9094,kafka-2:9094,kafka-3:9094;" in script and "--bootstrap-server kafka:9094" not in script
    assert "--replication-factor 3" in script and "--replication-factor 1" not in script
    assert dict(re.findall(r"\btopic (hadar\.[a-z]+) (\S+);", script)) == {t: config_string(t) for t in ALL_TOPICS}
    assert "min.insync.replicas" not in script   # the brokers' default (2) applies to every topic
    init = build_parser().parse_args(services["secure-init"]["command"])
    assert init.replication_factor == 3


def test_ha_every_hadar_service_gets_every_broker_and_the_store_endpoint():
    from shared.bus.settings import kafka_from_env
    config = _ha()
    services = config["services"]
    brokers = {f"{services[n]['environment']['KAFKA_ADVERTISED_HOST']}:9094" for n in KAFKA_NODES}
    for name in (*HADAR_SERVICES, "secure-init"):
        env = services[name]["environment"]
        assert set(env["HADAR_BOOTSTRAP"].split(",")) == brokers, name
        settings = kafka_from_env({"HADAR_BOOTSTRAP": env["HADAR_BOOTSTRAP"]})
        assert settings is not None and settings.bootstrap == env["HADAR_BOOTSTRAP"]   # taken as it is
        assert env["HADAR_S3_ENDPOINT"] == "http://minio:9000", name
    # `minio` is the proxy in front of every MinIO node, on the port the services use.
    proxy = services["minio"]
    conf = proxy["command"][0]
    assert "listen 9000;" in conf and proxy["deploy"]["replicas"] >= 2
    upstreams = set(re.findall(r"server (minio-\d+):9000", conf))
    assert upstreams == {n for n in services if re.fullmatch(r"minio-\d+", n)}
    assert "proxy_set_header Host $http_host;" in conf   # S3 signatures cover the Host header


def test_ha_minio_is_one_erasure_set_over_four_pinned_drives():
    services = _ha()["services"]
    nodes = sorted(n for n in services if re.fullmatch(r"minio-\d+", n))
    assert len(nodes) >= 4
    labels, volumes = set(), set()
    for name in nodes:
        spec = services[name]
        assert spec["hostname"] == name
        labels.add(_label(spec["deploy"]["placement"]["constraints"], "hadar.minio"))
        [volume] = spec["volumes"]
        assert volume["type"] == "volume"
        volumes.add(volume["source"])
        command = spec["command"]
        assert command[0] == "server"
        drives = [d for arg in command[1:] if arg.startswith("http") for d in _expand(arg)]
        assert {d.split("//")[1].split(":")[0] for d in drives} == set(nodes), name   # every node, one drive each
        assert len(drives) == len(nodes) and all(d.endswith(":9000" + volume["target"]) for d in drives)
        parity = int(spec["environment"]["MINIO_STORAGE_CLASS_STANDARD"].removeprefix("EC:"))
        assert 2 <= parity <= len(drives) // 2   # EC:2 of 4: reads survive 2 drives lost, writes 1
    assert len(labels) == len(volumes) == len(nodes)


@pytest.mark.parametrize("role", ["scheduler", "tracker"])
def test_ha_single_writers_run_an_active_and_a_standby_on_different_machines(role):
    service = _ha()["services"][role]
    flags = build_parser().parse_args(service["command"])
    assert flags.standby and service["deploy"]["replicas"] == 2
    assert service["deploy"]["placement"]["max_replicas_per_node"] == 1
    assert "node.labels.hadar.gpu != true" in service["deploy"]["placement"]["constraints"]
    # The lease outlasts a broker failover (the controller fences a dead broker after 9 s), so
    # losing a broker does not hand the role over.
    assert flags.lease_ttl_s > 9


def test_ha_keeps_the_single_node_stacks_secrets_and_principals():
    single, ha = _stack(), _ha()
    assert set(ha["secrets"]) == set(single["secrets"])
    assert set(ha["secrets"]) >= {s["source"] for svc in ha["services"].values() for s in svc.get("secrets", [])}
    for name in (*HADAR_SERVICES, "secure-init"):
        mine, theirs = ha["services"][name], single["services"][name]
        assert mine["secrets"] == theirs["secrets"], name
        drop = {"HADAR_BOOTSTRAP", "HADAR_S3_ENDPOINT"}
        assert {k: v for k, v in mine["environment"].items() if k not in drop} == {
            k: v for k, v in theirs["environment"].items() if k not in drop}, name
        assert mine["image"] == IMAGE
    for node in KAFKA_NODES:
        assert ha["services"][node]["secrets"] == single["services"]["kafka"]["secrets"]
    for name in (n for n in ha["services"] if n.startswith("minio-")):
        assert ha["services"][name]["secrets"] == single["services"]["minio"]["secrets"]


def test_ha_stack_is_hardened():
    config = _ha()
    assert config["networks"]["hadar"]["driver_opts"]["encrypted"] == "true"
    long_running = [n for n in config["services"] if n not in ("topics", "secure-init", "agent")]
    for name in long_running:
        deploy = config["services"][name]["deploy"]
        assert {"limits", "reservations"} <= set(deploy["resources"]), name
        assert deploy["update_config"]["failure_action"] == "rollback" and "rollback_config" in deploy, name
        assert "healthcheck" in config["services"][name], name
    for name, spec in config["services"].items():
        assert spec["logging"]["options"].keys() >= {"max-size", "max-file"}, name
        gpu = "node.labels.hadar.gpu == true" if name == "agent" else "node.labels.hadar.gpu != true"
        assert gpu in spec["deploy"]["placement"]["constraints"], name
