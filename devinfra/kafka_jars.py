"""Kafka's jars and a java to run them: fetched with ``mvn`` from Maven Central once, into the cache.

The jars are those deploy/kafka/pom.xml names (Kafka's broker and the logging binding its POM
leaves out); the cache entry is keyed by the pom's content, so editing the pom fetches again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from pathlib import Path

from devinfra.common import InfraError, InfraPaths, file_lock, log_tail, remove_tree

__all__ = ["DEFAULT_POM", "find_java", "fetch_kafka"]

DEFAULT_POM = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "pom.xml"
_POM_NS = "{http://maven.apache.org/POM/4.0.0}"


def find_java(env: Mapping[str, str] = os.environ) -> str:
    """Path of a ``java`` of version 17 or newer (``$JAVA_HOME`` first, then ``PATH``)."""
    candidates = []
    if env.get("JAVA_HOME"):
        candidates.append(str(Path(env["JAVA_HOME"]) / "bin" / "java"))
    on_path = shutil.which("java", path=env.get("PATH"))
    if on_path:
        candidates.append(on_path)
    found: list[str] = []
    for java in candidates:
        version = _java_major(java)
        if version is not None and version >= 17:
            return java
        if version is not None:
            found.append(f"{version} at {java}")
    raise InfraError("java 17+ not found" + (f" (found {', '.join(found)})" if found else ""))


def fetch_kafka(paths: InfraPaths, *, pom: Path = DEFAULT_POM,
                report: Callable[[str], None] = lambda _: None) -> Path:
    """The directory of Kafka's runtime jars, fetched with ``mvn`` on first use (cached).

    The cache entry is keyed by the pom's content, so editing the pom fetches again.
    """
    try:
        pom_bytes = pom.read_bytes()
    except OSError:
        raise InfraError(f"{pom} not found: run from a Hadar checkout") from None
    home = paths.cache / f"kafka-{_pom_kafka_version(pom_bytes)}-{hashlib.sha256(pom_bytes).hexdigest()[:10]}"
    lib = home / "lib"
    with file_lock(paths.cache / ".fetch-kafka.lock"):
        if (home / ".complete").exists():
            report(f"kafka: jars cached in {lib}")
            return lib
        mvn = shutil.which("mvn")
        if mvn is None:
            raise InfraError("mvn not found: needed once to fetch Kafka's jars from Maven Central")
        started = time.monotonic()
        staging = home / "lib.partial"
        remove_tree(staging)
        remove_tree(lib)
        home.mkdir(parents=True, exist_ok=True)
        paths.logs.mkdir(parents=True, exist_ok=True)
        log = paths.logs / "kafka-fetch.log"
        with open(log, "wb") as out:
            result = subprocess.run(
                [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom), "dependency:copy-dependencies",
                 "-DincludeScope=runtime", f"-DoutputDirectory={staging}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False,
            )
        if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            raise InfraError(f"mvn failed: {_mvn_error(log)} (log: {log})")
        staging.rename(lib)
        (home / ".complete").write_text("ok\n")
        report(f"kafka: fetched jars with mvn in {time.monotonic() - started:.1f}s")
        return lib


def _java_major(java: str) -> int | None:
    try:
        result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def _pom_kafka_version(pom_bytes: bytes) -> str:
    try:
        root = ET.fromstring(pom_bytes)
    except ET.ParseError as exc:
        raise InfraError(f"deploy/kafka/pom.xml is not valid XML: {exc}") from None
    version = root.findtext(f"{_POM_NS}properties/{_POM_NS}kafka.version")
    if not version:
        raise InfraError("deploy/kafka/pom.xml has no <kafka.version> property")
    return version.strip()


def _mvn_error(log: Path) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")) if log.exists() else ""
    errors = [line.removeprefix("[ERROR]").strip() for line in text.splitlines() if line.startswith("[ERROR]")]
    errors = [line for line in errors if line]
    return errors[0] if errors else log_tail(log)
