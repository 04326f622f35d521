"""Lifecycle shared by every service: HTTP ``/healthz`` and ``/metrics``, SIGTERM drain.

A service is an object with ``name``, a Prometheus ``registry``, ``async start()``,
``async stop()`` (drain: finish or hand back in-flight work, commit what is done, release
connections) and ``health() -> dict`` (with an ``ok`` bool). ``run_service`` runs one until
SIGTERM/SIGINT (or ``stop_event``), then drains it within ``drain_timeout_s``; a drain
that overruns is cancelled and logged, and the process still exits.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared.logging import get_logger


class Service(Protocol):
    name: str
    registry: CollectorRegistry

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


class HttpEndpoint:
    """aiohttp server exposing one service's health and metrics."""

    def __init__(self, service: Service, *, host: str = "0.0.0.0", port: int = 0) -> None:
        self._service = service
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, _: web.Request) -> web.Response:
        health = self._service.health()
        return web.json_response(health, status=200 if health.get("ok") else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._service.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def run_service(service: Service, *, http_host: str = "0.0.0.0", http_port: int | None = 0,
                      drain_timeout_s: float = 30.0, stop_event: asyncio.Event | None = None) -> None:
    """Run ``service`` until a signal or ``stop_event``; ``http_port=None`` serves no HTTP."""
    log = get_logger(service=service.name)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    http = HttpEndpoint(service, host=http_host, port=http_port) if http_port is not None else None
    try:
        if http is not None:
            await http.start()
            log.info("http.listening", port=http.port)
        await service.start()
        log.info("service.started")
        await stop.wait()
        log.info("service.draining", timeout_s=drain_timeout_s)
        try:
            await asyncio.wait_for(service.stop(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.error("service.drain_timeout", timeout_s=drain_timeout_s)
        log.info("service.stopped")
    finally:
        if http is not None:
            await http.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)
