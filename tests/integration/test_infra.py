"""The development servers answer, ``hadar infra`` reports them, and stopping is thorough.

With ``HADAR_BOOTSTRAP`` / ``HADAR_S3_*`` set (``make test``) the servers belong to
whoever started them, so only their endpoints are checked; otherwise the session started
them in its own run directory and ``hadar infra status`` must report that directory's
servers as up, at the same addresses, and ``hadar infra up`` must hand back their settings.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from devinfra import InfraPaths
from devinfra.common import is_running, port_accepts, port_released, spawn, stop_group
from services.cli import infra as infra_cli
from shared.bus.settings import kafka_from_env
from shared.store.settings import S3Settings, s3_from_env


def hadar_infra(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``hadar infra ARGS`` in-process (the subcommand's real parser and handlers)."""
    parser = argparse.ArgumentParser(prog="hadar")
    infra_cli.register(parser.add_subparsers(dest="command", required=True))
    capsys.readouterr()
    namespace = parser.parse_args(["infra", *args])
    code = namespace.func(namespace)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.kafka
@pytest.mark.s3
def test_servers_answer_and_status_reports_them(
    kafka_bootstrap: str, s3_settings: S3Settings, infra_paths: InfraPaths,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    host, _, port = kafka_bootstrap.split(",")[0].rpartition(":")
    assert port_accepts(int(port), host=host, timeout=5.0)
    with urllib.request.urlopen(f"{s3_settings.endpoint}/minio/health/live", timeout=5) as response:
        assert response.status == 200

    started_here = {"kafka": kafka_from_env() is None, "minio": s3_from_env() is None}
    if not any(started_here.values()):
        return  # both came from the environment: their owner runs `hadar infra status`
    monkeypatch.setenv("HADAR_RUN_DIR", str(infra_paths.run))
    code, out, _ = hadar_infra("status", capsys=capsys)
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    if started_here["kafka"]:
        assert lines["kafka"].startswith(f"up at {kafka_bootstrap} "), out
    if started_here["minio"]:
        assert lines["minio"].startswith(f"up at {s3_settings.endpoint} "), out
    assert code == (0 if all(started_here.values()) else 1), out
    if all(started_here.values()):
        code, out, err = hadar_infra("up", capsys=capsys)
        assert code == 0, err
        credentials = infra_paths.run / "credentials"
        assert out.splitlines() == [
            f"HADAR_BOOTSTRAP={kafka_bootstrap}",
            f"HADAR_S3_ENDPOINT={s3_settings.endpoint}",
            f"HADAR_S3_ACCESS_KEY_FILE={credentials / 's3-access-key'}",
            f"HADAR_S3_SECRET_KEY_FILE={credentials / 's3-secret-key'}",
        ]
        assert s3_settings.secret_key not in out + err   # the secret is only in an owner-only file
        secret_file = credentials / "s3-secret-key"
        assert secret_file.read_text().strip() == s3_settings.secret_key
        assert secret_file.stat().st_mode & 0o077 == 0
        loaded = s3_from_env(dict(line.split("=", 1) for line in out.splitlines()))
        assert loaded is not None and loaded.secret_key == s3_settings.secret_key
        assert "infra up: already running" in err


def test_status_and_down_on_an_empty_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HADAR_RUN_DIR", str(tmp_path / "run"))
    code, out, _ = hadar_infra("status", capsys=capsys)
    assert code == 1
    assert out.splitlines() == ["kafka: down", "minio: down"]
    for _ in range(2):
        code, _, err = hadar_infra("down", capsys=capsys)
        assert code == 0, err
        assert err.splitlines() == ["kafka: not running", "minio: not running"]


def test_stop_group_stops_the_whole_group_and_only_a_matching_one(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker-arg")
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    leader = spawn([sys.executable, "-c", script, marker], log=tmp_path / "out.log")
    deadline = time.monotonic() + 10
    while len(group_members(leader)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(leader)) == 2

    stop_group(leader, str(tmp_path / "another-run-dir"), grace=1.0)  # not this pid's: untouched
    assert is_running(leader, marker)

    stop_group(leader, marker, grace=5.0)
    assert not is_running(leader, marker)
    deadline = time.monotonic() + 5
    while group_members(leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(leader) == []


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_port_released_waits_for_a_listener_that_is_closing() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    assert not port_released(port, timeout=0.3)  # a live listener: taken
    threading.Timer(0.5, listener.close).start()
    assert port_released(port, timeout=10.0)  # closed a moment later: released
