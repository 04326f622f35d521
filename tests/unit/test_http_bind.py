"""/healthz and /metrics bind where the operator says: loopback unless told otherwise
(``--http-host`` > ``$HADAR_HTTP_HOST`` > 127.0.0.1), issue 15."""

from __future__ import annotations

import argparse
import socket

import pytest

import services.cli.serve as serve
from shared.runtime.service import HttpEndpoint
from tests.unit.test_bus_watchdog import Idle


def other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))   # TEST-NET-1: nothing is sent
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


async def test_the_endpoint_binds_loopback_by_default() -> None:
    http = HttpEndpoint(Idle())
    await http.start()
    try:
        assert http.port
        with socket.create_connection(("127.0.0.1", http.port), timeout=2):
            pass
        address = other_address()
        if address is not None:
            with pytest.raises(OSError):
                socket.create_connection((address, http.port), timeout=2).close()
    finally:
        await http.stop()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_common(parser, http_port=8081)
    return parser.parse_args(argv)


def test_host_comes_from_the_flag_then_the_environment_then_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HADAR_HTTP_HOST", raising=False)
    assert parse([]).http_host == "127.0.0.1"
    monkeypatch.setenv("HADAR_HTTP_HOST", "0.0.0.0")
    assert parse([]).http_host == "0.0.0.0"
    assert parse(["--http-host", "10.1.2.3"]).http_host == "10.1.2.3"
