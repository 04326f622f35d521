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
HADAR_SERVICES = ("scheduler", "tracker", "profiler", "agent")
IMAGE = "registry.example.internal/hadar:1.2.3@sha256:" + "ab" * 32


def _stack() -> dict:
    docker = shutil.which("docker")
    if docker is None:
        unavailable("the docker client is needed to validate deploy/stack.yml")
    env = {**os.environ, "HADAR_IMAGE": IMAGE}
    out = subprocess.run([docker, "stack", "config", "-c", str(STACK)], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_stack_validates_with_the_docker_client():
    config = _stack()
    assert set(HADAR_SERVICES) | {"kafka", "minio"} <= set(config["services"])
    assert config["services"]["agent"]["deploy"]["mode"] == "global"
    assert "healthcheck" in config["services"]["scheduler"]


@pytest.mark.parametrize("service", HADAR_SERVICES)
def test_each_service_command_is_a_cli_command(service, monkeypatch):
    command = _stack()["services"][service]["command"]
    monkeypatch.setenv("HADAR_NODE_ID", "node-a")
    args = build_parser().parse_args(command)   # argparse exits (SystemExit) on anything unknown
    assert args.command == "serve" and args.service == service


def _env_vars_read_by_code() -> set[str]:
    names: set[str] = set()
    for path in list((ROOT / "shared").rglob("*.py")) + list((ROOT / "services").rglob("*.py")):
        names |= set(re.findall(r"[\"'](HADAR_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    return names


def test_every_env_var_the_stack_sets_is_read_by_the_services():
    read = _env_vars_read_by_code()
    config = _stack()
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
    from shared.security.principals import PRINCIPALS, s3_user
    config = _stack()
    for service in HADAR_SERVICES:
        spec = config["services"][service]
        env = spec["environment"]
        principal = PRINCIPALS[service]
        assert env["HADAR_KAFKA_USERNAME"] == service
        assert env["HADAR_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["HADAR_BOOTSTRAP"] == "kafka:9094"
        mounted = {s["target"]: s["source"] for s in spec["secrets"]}
        wanted = {"kafka-ca": "hadar_kafka_ca", f"kafka-{service}-password": f"hadar_kafka_{service}_password"}
        if principal.uses_s3:
            assert env["HADAR_S3_ACCESS_KEY"] == s3_user(principal)
            assert env["HADAR_S3_SECRET_KEY_FILE"] == f"/run/secrets/s3-{service}-secret-key"
            wanted[f"s3-{service}-secret-key"] = f"hadar_s3_{service}_secret_key"
        else:
            assert not any(name.startswith(("HADAR_S3_ACCESS", "HADAR_S3_SECRET")) for name in env)
        assert mounted == wanted, service   # no service holds another's secret, none the root's
        # s3_from_env refuses an endpoint without credentials: a service given the endpoint
        # must be given its keys too, or it exits at start.
        assert ("HADAR_S3_ENDPOINT" not in env) or principal.uses_s3, service
        assert env["HADAR_KAFKA_PASSWORD_FILE"] == f"/run/secrets/kafka-{service}-password"
        assert not any("PASSWORD" in n and not n.endswith("_FILE") for n in env), service


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
        assert f"kafka-{name}-password" in targets
    # read_secrets reads exactly the files the stack mounts (a missing one is a one-line error)
    import tempfile
    from pathlib import Path as P
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            (P(tmp) / target).write_text("x\n")
        kafka, s3 = read_secrets(P(tmp))
    assert set(kafka) == set(SERVICE_PRINCIPALS) and set(s3) == {"agent", "tracker", "cli", "scheduler", "profiler"}
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


def test_the_healthcheck_probes_the_port_the_services_listen_on(monkeypatch):
    config = _stack()
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
