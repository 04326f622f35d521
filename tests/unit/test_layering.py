"""Package layering, read from the source: which package may import which.

* ``shared`` is the bottom layer: it imports no ``services`` package.
* The services (agent, tracker, profiler, scheduler) do not import the CLI package
  ``services.cli``; the CLI wires them, never the other way round.
* The profiler does not import the agent: what both need (the emulation's slowdowns)
  lives in ``shared``.

Every import statement counts, also one inside a function or an ``if TYPE_CHECKING``
block; relative imports are resolved first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("agent", "tracker", "profiler", "scheduler")


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


def violations(path: Path) -> list[str]:
    module = module_name(path)
    rules: list[tuple[str, str]] = []   # (forbidden package, why)
    if within(module, "shared"):
        rules.append(("services", "shared imports no service"))
    if within(module, "shared") or any(within(module, f"services.{s}") for s in SERVICES):
        rules.append(("services.cli", "only the CLI imports the CLI package"))
    if within(module, "services.profiler"):
        rules.append(("services.agent", "the profiler does not import the agent"))
    names = set(imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py"))
    return [f"{module} imports {name}: {why}" for name in sorted(names)
            for package, why in rules if within(name, package)]


def checked_files() -> list[Path]:
    dirs = [ROOT / "shared", *(ROOT / "services" / s for s in SERVICES)]
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def test_the_checked_packages_exist() -> None:
    files = checked_files()
    for top in ("shared", *(f"services.{s}" for s in SERVICES)):
        assert any(within(module_name(p), top) for p in files), top


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layering(path: Path) -> None:
    assert violations(path) == []


def test_the_checker_sees_every_form_of_import() -> None:
    source = ("import services.cli.main\n"
              "from services import cli\n"
              "def f():\n    from services.agent.daemon.emulation import slowdown\n"
              "from .. import agent\n")
    names = set(imported_modules(source, "services.profiler.estimate"))
    assert {"services.cli.main", "services.cli", "services.agent.daemon.emulation", "services.agent"} <= names


def test_paths_derived_from_module_locations_point_into_the_checkout() -> None:
    # A module that finds the checkout from its own location must be updated when it moves
    # (the agent's worker cwd and PYTHONPATH, the Kafka pom of the development servers).
    from devinfra.kafka import DEFAULT_POM
    from services.agent.daemon.process import PROJECT_ROOT

    assert PROJECT_ROOT == ROOT and (PROJECT_ROOT / "services" / "agent" / "worker" / "main.py").is_file()
    assert DEFAULT_POM.is_file()
