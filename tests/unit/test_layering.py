"""Package layering, read from the source: which package may import which.

``shared`` is built in layers; a module may import its own layer and the layers listed
before it, never one after it:

    foundation (errors, clock, secrets) < wire < domain < zoo < bus, store (neither imports
    the other) < persistence < runtime < security

* ``shared`` imports no ``services`` package and no ``devinfra`` (development tooling).
  Only the CLI (``services.cli``) may import ``devinfra``.
* The services (agent, tracker, profiler, scheduler) do not import the CLI package
  ``services.cli``; the CLI wires them, never the other way round. The profiler does not
  import the agent (what both need, the emulation's slowdowns, lives in ``shared``).
* The scheduler: ``core`` imports nothing else of the scheduler; ``policies`` only
  ``core``; ``live`` and ``sim`` import ``core`` and ``policies`` but not each other.
  Within ``policies``, ``lp`` imports no policy, and base ``hadar`` imports no ``hadare``.
* The agent: ``daemon`` (the asyncio service) and ``worker`` (the training subprocess)
  never import each other; what crosses the process boundary is ``protocol``.
* The tracker: ``averaging`` (the pure numerical core) imports nothing else of the tracker.
* ``hadar_sdk`` (imported by users' own training scripts, which run where only it is readable)
  imports only torch, numpy, safetensors and the standard library: nothing of ``shared``,
  ``services`` or ``devinfra``.

Every import statement counts, also one inside a function or an ``if TYPE_CHECKING``
block; relative imports are resolved first.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("agent", "tracker", "profiler", "scheduler")

# shared's layers, lowest first; a module may import its own layer and those before it.
SHARED_LAYERS: tuple[tuple[str, ...], ...] = (
    ("shared.errors", "shared.clock", "shared.secrets"),
    ("shared.wire",),
    ("shared.domain",),
    ("shared.zoo",),
    ("shared.bus", "shared.store"),
    ("shared.persistence",),
    ("shared.runtime",),
    ("shared.security",),
)

# (importing package, forbidden package, why), beyond shared's layers.
RULES: tuple[tuple[str, str, str], ...] = (
    *(("hadar_sdk", p, "the SDK runs in a user's trainer, where only it is readable")
      for p in ("shared", "services", "devinfra")),
    ("shared", "services", "shared imports no service"),
    ("shared", "devinfra", "shared imports no development tooling"),
    *((f"services.{s}", "services.cli", "only the CLI imports the CLI package") for s in SERVICES),
    *((f"services.{s}", "devinfra", "only the CLI imports development tooling") for s in SERVICES),
    ("shared.bus", "shared.store", "the two ports are independent"),
    ("shared.store", "shared.bus", "the two ports are independent"),
    ("services.profiler", "services.agent", "the profiler does not import the agent"),
    *(("services.scheduler.core", f"services.scheduler.{p}", "core imports nothing else of the scheduler")
      for p in ("policies", "live", "sim", "cli", "config")),
    *(("services.scheduler.policies", f"services.scheduler.{p}", "policies import only core")
      for p in ("live", "sim", "cli", "config")),
    ("services.scheduler.live", "services.scheduler.sim", "the live loop does not import the simulator"),
    ("services.scheduler.sim", "services.scheduler.live", "the simulator does not import the live loop"),
    *(("services.scheduler.policies.lp", f"services.scheduler.policies.{p}", "the shared LP imports no policy")
      for p in ("hadar", "hadare", "gavel", "gang", "tiresias", "yarn_cs")),
    ("services.scheduler.policies.hadar", "services.scheduler.policies.hadare", "base Hadar does not import HadarE"),
    ("services.agent.daemon", "services.agent.worker", "the daemon talks to workers only through protocol"),
    ("services.agent.worker", "services.agent.daemon", "a worker talks to the daemon only through protocol"),
    *(("services.tracker.averaging", f"services.tracker.{m}", "averaging imports nothing else of the tracker")
      for m in ("service", "state", "consolidator", "model_files", "jobs", "acceptance", "config", "snapshot",
                "lifecycle", "due", "placements", "pending", "attempts", "metrics", "store_reader", "cli")),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module an import statement of ``source`` names (``from a import b`` gives ``a`` and ``a.b``)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def shared_layer(name: str) -> int | None:
    for level, packages in enumerate(SHARED_LAYERS):
        if any(within(name, p) for p in packages):
            return level
    return None


def violations(path: Path) -> list[str]:
    return violations_of(module_name(path), path.read_text(encoding="utf-8"), is_package=path.name == "__init__.py")


def violations_of(module: str, source: str, *, is_package: bool = False) -> list[str]:
    names = set(imported_modules(source, module, is_package=is_package))
    found = [f"{module} imports {name}: {why}" for name in sorted(names)
             for importer, forbidden, why in RULES if within(module, importer) and within(name, forbidden)]
    mine = shared_layer(module)
    if mine is not None:
        found += [f"{module} imports {name}: a lower layer of shared imports a higher one"
                  for name in sorted(names) if (theirs := shared_layer(name)) is not None and theirs > mine]
    return found


def checked_files() -> list[Path]:
    dirs = [ROOT / "shared", ROOT / "devinfra", ROOT / "hadar_sdk",
            *(ROOT / "services" / s for s in (*SERVICES, "cli"))]
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def test_the_checked_packages_exist() -> None:
    files = {module_name(p) for p in checked_files()}
    for package in {*(p for layer in SHARED_LAYERS for p in layer), *(r[0] for r in RULES)}:
        assert any(within(m, package) for m in files), package
    assert all(shared_layer(m) is not None for m in files if within(m, "shared") and m != "shared"), \
        "every module of shared belongs to a layer"


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layering(path: Path) -> None:
    assert violations(path) == []


SDK_DEPENDENCIES = frozenset({"hadar_sdk", "torch", "numpy", "safetensors", "__future__"})


@pytest.mark.parametrize("path", sorted((ROOT / "hadar_sdk").rglob("*.py")), ids=lambda p: p.name)
def test_the_sdk_imports_only_torch_numpy_safetensors_and_the_standard_library(path: Path) -> None:
    module = module_name(path)
    names = imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    outside = sorted({n for n in names if n.split(".")[0] not in SDK_DEPENDENCIES | sys.stdlib_module_names})
    assert outside == [], f"{module} imports {outside}"


def test_the_checker_sees_every_form_of_import() -> None:
    source = ("import services.cli.main\n"
              "from services import cli\n"
              "def f():\n    from services.agent.daemon.emulation import slowdown\n"
              "from .. import agent\n")
    names = set(imported_modules(source, "services.profiler.estimate"))
    assert {"services.cli.main", "services.cli", "services.agent.daemon.emulation", "services.agent"} <= names


def test_a_lower_layer_importing_a_higher_one_is_caught() -> None:
    found = violations_of("shared.wire.probe", "from shared.runtime.service import run_service\n")
    assert "shared.wire.probe imports shared.runtime.service: a lower layer of shared imports a higher one" in found
    assert violations_of("shared.runtime.probe", "from shared.wire.events import encode\n") == []
    assert "hadar_sdk.probe imports shared.errors: the SDK runs in a user's trainer, where only it is readable" \
        in violations_of("hadar_sdk.probe", "from shared.errors import HadarError\n")
    assert violations_of("services.agent.daemon.probe", "import services.agent.worker.training\n") == [
        "services.agent.daemon.probe imports services.agent.worker.training: "
        "the daemon talks to workers only through protocol"]


def test_paths_derived_from_module_locations_point_into_the_checkout() -> None:
    # A module that finds the checkout from its own location must be updated when it moves
    # (the agent's worker cwd and PYTHONPATH, the Kafka pom of the development servers).
    from devinfra.kafka import DEFAULT_POM
    from services.agent.daemon.process import PROJECT_ROOT

    assert PROJECT_ROOT == ROOT and (PROJECT_ROOT / "services" / "agent" / "worker" / "main.py").is_file()
    assert DEFAULT_POM.is_file()
