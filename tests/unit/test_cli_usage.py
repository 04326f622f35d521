"""CLI misuse: a one-line error naming the field, exit code 2, nothing published."""

from __future__ import annotations

import os

import pytest

from services.cli.main import main


@pytest.mark.parametrize("argv, field", [
    (["submit", "--model", "resnet", "--dataset", "digits", "--workers", "99", "--iterations", "5"], "workers"),
    (["submit", "--model", "resnet", "--dataset", "digits", "--workers", "1", "--iterations", "x"], "iterations"),
    (["submit", "--model", "nosuch", "--dataset", "digits", "--workers", "1", "--iterations", "5"], "model"),
    (["submit", "--model", "resnet", "--dataset", "imagenet", "--workers", "1", "--iterations", "5"], "dataset"),
    (["submit", "--id", "Bad/../id", "--model", "resnet", "--dataset", "digits", "--workers", "1",
      "--iterations", "5"], "job_id"),
    (["submit", "--dataset", "digits", "--workers", "1", "--iterations", "5"], "model"),
])
def test_bad_submissions_exit_2_naming_the_field(argv, field, capsys, monkeypatch):
    monkeypatch.delenv("HADAR_BOOTSTRAP", raising=False)   # validation happens before any connection
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err


def test_job_file_errors_name_the_field(tmp_path, capsys):
    bad = tmp_path / "job.yaml"
    bad.write_text("model: resnet\ndataset: digits\nworkers: 2\niterations: 10\ngpus: 4\n")
    assert main(["submit", str(bad)]) == 2
    assert "gpus: unknown field" in capsys.readouterr().err


def test_commands_needing_a_broker_say_so(capsys, monkeypatch):
    monkeypatch.delenv("HADAR_BOOTSTRAP", raising=False)
    assert main(["jobs"]) == 2
    assert "HADAR_BOOTSTRAP" in capsys.readouterr().err


def test_model_of_a_malformed_job_id_is_a_usage_error(tmp_path, capsys):
    assert main(["model", "../other", "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a job id" in err
@pytest.mark.parametrize("argv, source", [
    (["serve", "tracker", "--finish-timeout-s", "-1"], "--finish-timeout-s"),
    (["serve", "tracker", "--tick-s", "0"], "--tick-s"),
    (["serve", "profiler", "--alpha", "2"], "--alpha"),
    (["serve", "profiler", "--threshold", "-0.5"], "--threshold"),
    (["serve", "agent", "--node-id", "no/slash"], "--node-id"),
    (["serve", "agent", "--node-id", "n1", "--heartbeat-s", "0"], "--heartbeat-s"),
    (["serve", "agent", "--node-id", "n1", "--emulate", "v100:0"], "--emulate"),
    (["serve", "agent"], "node_id: required"),
])
def test_bad_service_settings_exit_2_naming_the_source(argv, source, capsys, monkeypatch):
    for name in ("HADAR_BOOTSTRAP", "HADAR_NODE_ID"):
        monkeypatch.delenv(name, raising=False)   # validation happens before any connection
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and source in err


def test_a_bad_service_variable_exits_2_naming_it(capsys, monkeypatch):
    monkeypatch.delenv("HADAR_BOOTSTRAP", raising=False)
    monkeypatch.setenv("HADAR_TRACKER_FINISH_TIMEOUT_S", "soon")
    assert main(["serve", "tracker"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HADAR_TRACKER_FINISH_TIMEOUT_S: expected a finite number" in err


@pytest.mark.parametrize("content", [
    os.urandom(4096),                                   # not text
    b"a: 1\n" * 2_000_000,                              # 10 MB: refused by size, not parsed for a minute
    b"[" * 100_000 + b"]" * 100_000,                    # nesting deep enough to blow the parser's stack
    b"\xef\xbb\xbf" + b"\x00" * 100,                    # a BOM then NULs
])
def test_a_hostile_job_file_is_one_line_and_exit_2(content, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HADAR_BOOTSTRAP", raising=False)
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hadar submit: error: file:"), err[:300]


@pytest.mark.parametrize("command", [["watch", "j"], ["status", "j"], ["jobs"], ["cancel", "j"]])
def test_an_unreachable_broker_is_one_line_and_exit_3_not_a_job_outcome(command, capsys):
    # Exit 1 means "cancelled" to a `hadar watch` script: a broker failure must not read as that.
    assert main([*command, "--bootstrap", "127.0.0.1:1"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot connect" in err
