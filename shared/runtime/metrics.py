"""What every service's ``/metrics`` carries besides its own series.

Naming rule for every Hadar metric (docs/architecture.md "Monitoring"): ``hadar_<service>_``
then what is measured, then its unit in base units (``_seconds``, ``_bytes``), counters
ending in ``_total`` (prometheus_client adds it to a Counter's name). ``<service>`` is one
of :data:`SERVICES`.

:func:`register_standard` adds, once per registry:

* ``process_*`` -- prometheus_client's process collector (CPU seconds, resident memory,
  open file descriptors, start time) of the serving process;
* ``hadar_<service>_build_info{version,python}`` -- always 1; the labels say what runs.

:func:`register_authorship` adds, for a service whose bus verifies authorship,
``hadar_<service>_records_refused_authorship_total{reason}`` (reasons:
:data:`shared.security.authorship.REFUSALS`); each refused record is also a dead letter.

It is called by :class:`shared.runtime.service.HttpEndpoint`, so every served registry has them.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.bus.base import RecordVerifier

__all__ = ["SERVICES", "register_standard", "register_authorship", "package_version"]

SERVICES = ("scheduler", "tracker", "profiler", "agent")
_MARK = "_hadar_standard_metrics"


def package_version() -> str:
    try:
        return version("hadar")
    except PackageNotFoundError:   # run from a source tree that was not installed
        return "0+unknown"


def register_standard(registry: CollectorRegistry, service: str) -> None:
    """Register ``process_*`` and ``hadar_<service>_build_info`` on ``registry``; a second
    call on the same registry does nothing (a registry refuses duplicate names)."""
    if getattr(registry, _MARK, None) is not None:
        return
    ProcessCollector(registry=registry)
    info = Gauge(f"hadar_{service}_build_info", "Always 1; labels: the running Hadar version and Python",
                 ["version", "python"], registry=registry)
    info.labels(version=package_version(), python=platform.python_version()).set(1)
    setattr(registry, _MARK, service)


class _AuthorshipRefusals(Collector):
    def __init__(self, service: str, verifier: RecordVerifier) -> None:
        self._name, self._verifier = f"hadar_{service}_records_refused_authorship", verifier

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, "Records refused because their author may not have made "
                                                 "them (each also dead-lettered), by reason", labels=["reason"])
        for reason, count in self._verifier.refusals.items():
            family.add_metric([reason], count)
        return [family]


def register_authorship(registry: CollectorRegistry, service: str, verifier: RecordVerifier) -> None:
    """Register ``hadar_<service>_records_refused_authorship_total{reason}`` of ``verifier``."""
    registry.register(_AuthorshipRefusals(service, verifier))
