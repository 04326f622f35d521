"""Lifecycle shared by every service: HTTP ``/healthz`` and ``/metrics``, SIGTERM drain.

A service is an object with ``name``, a Prometheus ``registry``, ``async start()``,
``async stop()`` (drain: finish or hand back in-flight work, commit what is done, release
connections) and ``health() -> dict`` (with an ``ok`` bool). ``run_service`` runs one until
SIGTERM/SIGINT (or ``stop_event``), then drains it within ``drain_timeout_s``; a drain
that overruns is cancelled and logged, and the process still exits.

Given the service's ``bus``, a :class:`BusWatchdog` pings the broker every
``bus_check_s``. An outage shorter than ``bus_deadline_s`` changes nothing (clients
reconnect and retry by themselves; ``/healthz`` reports ``bus_reachable: false`` but stays
200). Past the deadline the service truly cannot work: ``/healthz`` answers 503, the
service is drained and ``run_service`` returns 1, so the process exits non-zero and swarm
restarts it. A clean stop returns 0.

HTTP binds ``http_host`` (default loopback; the operator chooses, the stack uses 0.0.0.0).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared.bus import Bus, BusError
from shared.runtime.metrics import register_authorship, register_standard

BUS_CHECK_S = 5.0
BUS_DEADLINE_S = 120.0


class Service(Protocol):
    name: str
    registry: CollectorRegistry

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


class BusWatchdog:
    """Whether the broker answered recently; ``fatal`` once it has not for ``deadline_s``."""

    def __init__(self, bus: Bus, *, interval_s: float = BUS_CHECK_S, deadline_s: float = BUS_DEADLINE_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._bus = bus
        self._interval_s = interval_s
        self._deadline_s = deadline_s
        self._now = now
        self._last_ok = now()
        self._reachable = True
        self.fatal: str | None = None

    def unreachable_s(self) -> float:
        return 0.0 if self._reachable else self._now() - self._last_ok

    def health(self) -> dict[str, Any]:
        return {"ok": self.fatal is None, "bus_reachable": self._reachable,
                "bus_unreachable_s": round(self.unreachable_s(), 1)}

    async def run(self, stop: asyncio.Event) -> None:
        """Ping until ``stop``; past the deadline set ``fatal`` and ``stop``."""
        log = structlog.get_logger(__name__)
        while not stop.is_set():
            try:
                await self._bus.ping(timeout_s=min(5.0, max(self._interval_s, 0.01)))
                if not self._reachable:
                    log.info("bus.reachable_again", unreachable_s=round(self._now() - self._last_ok, 1))
                self._reachable, self._last_ok = True, self._now()
            except BusError as exc:
                if self._reachable:
                    log.warning("bus.unreachable", error=str(exc)[:200], deadline_s=self._deadline_s)
                self._reachable = False
                if self._now() - self._last_ok > self._deadline_s:
                    self.fatal = f"broker unreachable for more than {self._deadline_s:g} s"
                    log.critical("bus.unreachable_past_deadline", deadline_s=self._deadline_s)
                    stop.set()
                    return
            try:
                await asyncio.wait_for(stop.wait(), self._interval_s)
            except TimeoutError:
                pass


class HttpEndpoint:
    """aiohttp server exposing one service's health and metrics (its registry plus
    ``process_*`` and ``hadar_<service>_build_info``, :mod:`shared.runtime.metrics`)."""

    def __init__(self, service: Service, *, host: str = "127.0.0.1", port: int = 0,
                 watchdog: BusWatchdog | None = None) -> None:
        register_standard(service.registry, service.name)
        self._service = service
        self._watchdog = watchdog
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
        health = dict(self._service.health())
        if self._watchdog is not None:
            bus = self._watchdog.health()
            health.update(bus_reachable=bus["bus_reachable"], bus_unreachable_s=bus["bus_unreachable_s"])
            health["ok"] = bool(health.get("ok")) and bus["ok"]
        return web.json_response(health, status=200 if health.get("ok") else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self._service.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def run_service(service: Service, *, http_host: str = "127.0.0.1", http_port: int | None = 0,
                      drain_timeout_s: float = 30.0, stop_event: asyncio.Event | None = None,
                      bus: Bus | None = None, bus_check_s: float = BUS_CHECK_S,
                      bus_deadline_s: float = BUS_DEADLINE_S) -> int:
    """Run ``service`` until a signal or ``stop_event``; ``http_port=None`` serves no HTTP.

    Returns the process's exit code: 0 after a clean stop, 1 when the watchdog of ``bus``
    found the broker unreachable past ``bus_deadline_s`` (see the module docstring)."""
    log = structlog.get_logger(__name__).bind(service=service.name)
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    watchdog = BusWatchdog(bus, interval_s=bus_check_s, deadline_s=bus_deadline_s) if bus is not None else None
    if bus is not None and bus.verifier is not None:
        register_authorship(service.registry, service.name, bus.verifier)
    http = HttpEndpoint(service, host=http_host, port=http_port, watchdog=watchdog) if http_port is not None else None
    watching: asyncio.Task[None] | None = None
    try:
        if http is not None:
            await http.start()
            log.info("http.listening", host=http_host, port=http.port)
        await service.start()
        log.info("service.started")
        if watchdog is not None:
            watching = asyncio.create_task(watchdog.run(stop), name="bus-watchdog")
        await stop.wait()
        log.info("service.draining", timeout_s=drain_timeout_s)
        try:
            await asyncio.wait_for(service.stop(), drain_timeout_s)
        except TimeoutError:
            log.error("service.drain_timeout", timeout_s=drain_timeout_s)
        log.info("service.stopped")
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        if http is not None:
            await http.stop()
        for sig in installed:
            loop.remove_signal_handler(sig)
    if watchdog is not None and watchdog.fatal is not None:
        log.critical("service.exit", code=1, reason=watchdog.fatal)
        return 1
    return 0
