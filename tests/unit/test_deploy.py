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

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "deploy" / "stack.yml"
HADAR_SERVICES = ("scheduler", "tracker", "profiler", "agent")


def _stack() -> dict:
    docker = shutil.which("docker")
    if docker is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the docker client is needed to validate deploy/stack.yml")
        pytest.skip("docker client not installed")
    out = subprocess.run([docker, "stack", "config", "-c", str(STACK)], capture_output=True, text=True, timeout=60)
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
    for service in HADAR_SERVICES:
        env = config["services"][service].get("environment", {})
        unknown = sorted(set(env) - read)
        assert not unknown, f"{service} sets env vars no service reads: {unknown}"
