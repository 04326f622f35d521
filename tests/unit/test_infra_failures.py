"""A development server that dies while starting is reported with why: its exit code or the
signal that killed it, and the last lines of its log (its stdout and stderr), in one line.

Real processes (``sh``) started with :func:`devinfra.common.spawn`, as the servers are.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from devinfra.common import (
    InfraError,
    exit_status,
    failure_tail,
    is_running,
    log_tail,
    spawn,
    wait_for,
)


def _start(tmp_path: Path, script: str) -> tuple[int, str, Path]:
    marker = f"hadar-test-{uuid.uuid4().hex}"
    log = tmp_path / "server.log"
    pid = spawn(["sh", "-c", f": {marker}; {script}"], log=log)
    return pid, marker, log


def _failure(pid: int, marker: str, log: Path) -> str:
    with pytest.raises(InfraError) as caught:
        wait_for(lambda: False, what="server", timeout=30, alive=lambda: is_running(pid, marker), log=log,
                 pid=pid, interval=0.02)
    return str(caught.value)


def test_an_exit_code_and_the_last_lines_of_the_log_are_reported(tmp_path: Path) -> None:
    pid, marker, log = _start(tmp_path, "for i in 1 2 3 4 5 6 7; do echo line $i; done; echo oops >&2; exit 3")
    message = _failure(pid, marker, log)
    assert "exited while starting (exit code 3)" in message
    assert "line 4 | line 5 | line 6 | line 7 | oops" in message   # stderr too: it goes to the log
    assert "line 3" not in message and "\n" not in message
    assert str(log) in message


def test_a_process_killed_without_output_says_by_which_signal(tmp_path: Path) -> None:
    pid, marker, log = _start(tmp_path, "kill -9 $$")
    message = _failure(pid, marker, log)
    assert "(killed by SIGKILL)" in message and "(no output)" in message


def test_a_server_seen_gone_before_it_has_exited_still_reports_its_exit_code(tmp_path: Path) -> None:
    # A JVM that is exiting drops its command line (``/proc/<pid>/cmdline`` reads empty) before
    # the kernel makes it a zombie, so ``alive`` can say it is gone while ``poll`` says it still
    # runs. CI once printed "exit status unknown: still running" for a broker exiting with code 1.
    pid, _marker, log = _start(tmp_path, "echo broken; sleep 0.5; exit 1")
    with pytest.raises(InfraError) as caught:
        wait_for(lambda: False, what="server", timeout=30, alive=lambda: False, log=log, pid=pid)
    assert "exited while starting (exit code 1)" in str(caught.value), caught.value


def test_exit_status_of_a_process_not_started_here_is_unknown() -> None:
    assert exit_status(1) == "exit status unknown: not started by this process"


def test_log_tail_keeps_one_line_by_default(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text("first\n\nsecond\n")
    assert log_tail(log) == "second"
    assert log_tail(log, lines=5) == "first | second"
    assert log_tail(tmp_path / "missing.log") == "(no output)"


def test_a_java_stack_trace_shows_its_message_not_its_frames(tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    log.write_text("[2026-12-01] INFO starting (kafka.Kafka$)\n"
                   "[2026-12-01] ERROR Exiting Kafka due to fatal exception (kafka.Kafka$)\n"
                   "java.lang.RuntimeException: Invalid meta.properties version 7\n"
                   "\tat org.apache.kafka.metadata.properties.MetaProperties$Builder.build(MetaProperties.java:181)"
                   " ~[kafka-metadata-4.1.1.jar:?]\n"
                   "\tat kafka.Kafka.main(Kafka.scala) [kafka_2.13-4.1.1.jar:?]\n"
                   "\t... 3 more\n")
    assert failure_tail(log, lines=2) == ("[2026-12-01] ERROR Exiting Kafka due to fatal exception (kafka.Kafka$) | "
                                          "java.lang.RuntimeException: Invalid meta.properties version 7")
