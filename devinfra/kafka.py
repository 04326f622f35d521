"""A single-node Apache Kafka (KRaft, combined broker+controller) for development and tests.

Jars come from Maven Central through ``mvn`` and deploy/kafka/pom.xml, once, into the
cache. The broker binds 127.0.0.1 only, on free ports, with settings for fast tests
(no initial rebalance delay, one offsets partition, replication 1) and a small heap.
It counts as ready when its port accepts and a Metadata request lists a broker.

A new broker gets free ports and a new cluster id; a restarted one (:func:`restart_kafka`)
gets the recorded ones and its existing storage, so clients find it where it was.
``secure=True`` starts it with a SASL_SSL listener, SCRAM users and the StandardAuthorizer
(:mod:`devinfra.broker_auth`); a restart keeps the mode it was recorded with.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from devinfra.broker_auth import (
    BrokerSecurity,
    admin_security,
    listener_properties,
    prepare,
    scram_args,
    write_argfile,
)
from devinfra.common import (
    Clock,
    InfraError,
    InfraPaths,
    file_lock,
    free_port,
    is_running,
    keep_previous,
    load_recorded,
    log_tail,
    port_accepts,
    port_released,
    remove_tree,
    spawn,
    stop_group,
    wait_for,
)
from shared.bus.settings import KafkaSecurity
from shared.security.files import write_private

__all__ = [
    "KafkaServer", "DEFAULT_POM", "find_java", "fetch_kafka", "start_kafka", "restart_kafka", "kafka_properties",
    "EXTRA_PROPERTIES", "extra_properties",
    "load_kafka", "kafka_healthy", "new_cluster_id",
]

NAME = "kafka"
DEFAULT_POM = Path(__file__).resolve().parents[1] / "deploy" / "kafka" / "pom.xml"
JVM_HEAP = ("-Xms256m", "-Xmx512m")
READY_TIMEOUT_S = 120.0
_POM_NS = "{http://maven.apache.org/POM/4.0.0}"

LOG4J2_PROPERTIES = """\
# Written by `hadar infra up`: everything to the console, which goes to kafka.log.
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.controller.name = org.apache.kafka.controller
logger.controller.level = WARN
logger.raft.name = org.apache.kafka.raft
logger.raft.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
"""


@dataclass(frozen=True, kw_only=True)
class KafkaServer:
    """A running (or recorded) development broker."""

    pid: int
    port: int
    controller_port: int
    run_dir: str
    cluster_id: str
    secure: bool = False

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return Path(self.run_dir) / "kafka.log"

    @property
    def marker(self) -> str:
        """A string only this server's command line contains (its config file path)."""
        return str(Path(self.run_dir) / "server.properties")


EXTRA_PROPERTIES = "kafka-extra.properties"


def extra_properties(run: Path) -> dict[str, str]:
    """Operator overrides of the broker config: ``key=value`` lines of
    ``{run}/kafka-extra.properties`` (``#`` comments and blank lines ignored), applied at
    every start and restart. The file is outside the server's own directory, so a fresh start
    does not remove it. E.g. a test that needs time-based retention to act within seconds
    sets ``log.retention.check.interval.ms`` (the broker's default checks every 5 minutes)."""
    path = run / EXTRA_PROPERTIES
    if not path.exists():
        return {}
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise InfraError(f"{path}:{number}: expected key=value, got {line!r}")
        found[key.strip()] = value.strip()
    return found


def kafka_properties(*, port: int, controller_port: int, data_dir: Path,
                     security: BrokerSecurity | None = None,
                     extra: Mapping[str, str] | None = None) -> str:
    """The broker config: one combined KRaft node with a static quorum, tuned for tests
    (with ``security``: a SASL_SSL client listener and ACLs, see :mod:`.kafka_secure`);
    ``extra`` entries are added last and win."""
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "true",
    }
    if security is not None:
        settings.update(listener_properties(security, port=port, controller_port=controller_port))
        settings["auto.create.topics.enable"] = "false"
    settings.update(extra or {})
    lines = ["# Written by `hadar infra up` for development and tests."]
    lines += [f"{name}={value}" for name, value in settings.items()]
    return "\n".join(lines) + "\n"


def new_cluster_id(random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """A Kafka cluster id as ``StorageTool random-uuid`` makes one (without starting a JVM):
    16 random bytes, URL-safe base64 without padding, never starting with '-'."""
    while True:
        text = base64.urlsafe_b64encode(random_bytes(16)).decode().rstrip("=")
        if not text.startswith("-"):
            return text


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


def load_kafka(paths: InfraPaths) -> KafkaServer | None:
    """The recorded broker of this run directory, whether or not it still runs."""
    return load_recorded(paths.state_file(NAME), KafkaServer)


def kafka_healthy(server: KafkaServer, timeout: float = 5.0) -> bool:
    """Whether the broker's port accepts and a Metadata request lists at least one broker
    (as the admin, for a secured broker)."""
    security = admin_security(Path(server.run_dir).parent) if server.secure else None
    return port_accepts(server.port) and _metadata_lists_broker(server.bootstrap, timeout, security)


def start_kafka(paths: InfraPaths, lib: Path, java: str, *, clock: Clock = time.monotonic,
                attempts: int = 3, secure: bool = False) -> KafkaServer:
    """Format fresh storage and start a new broker; return once it is ready (state recorded).

    Retries with new ports when one was taken between choosing it and binding it. Refuses
    (and touches nothing) when the run directory holds broker data that no state file
    describes: data is only ever deleted by ``down``. A start that fails removes what it
    created, so the next ``up`` starts afresh again.
    """
    data_dir = paths.server_dir(NAME) / "data"
    if data_dir.is_dir() and any(data_dir.iterdir()):
        raise InfraError(f"kafka: {data_dir} holds data but no usable state.json records its port and "
                         "cluster id; `hadar infra down` deletes it")
    for attempt in range(1, attempts + 1):
        try:
            return _start_fresh(paths, lib, java, clock=clock, secure=secure)
        except InfraError as exc:
            if attempt == attempts or "Address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")


def restart_kafka(paths: InfraPaths, lib: Path, java: str, recorded: KafkaServer, *,
                  clock: Clock = time.monotonic) -> KafkaServer:
    """Start the recorded broker again: the same data directory, ports and cluster id, so
    clients reconnect to the address they had and find every record it had stored.

    The recorded process must be gone (stop it first). Never formats storage that exists
    and never picks another port: a port another process took is an error. On failure
    the data and the state file are kept for the next try.
    """
    if is_running(recorded.pid, recorded.marker):
        raise InfraError(f"kafka: still running (pid {recorded.pid}); stop it before restarting")
    for port in (recorded.port, recorded.controller_port):
        if not port_released(port):
            raise InfraError(f"kafka: port {port} is taken by another process; free it and run "
                             "`hadar infra restart kafka` (`hadar infra down` deletes the data instead)")
    run_dir = Path(recorded.run_dir)
    formatted = (run_dir / "data" / "meta.properties").exists()
    return _launch(paths, lib, java, port=recorded.port, controller_port=recorded.controller_port,
                   cluster_id=recorded.cluster_id, format_storage=not formatted, clock=clock,
                   secure=recorded.secure)


def _start_fresh(paths: InfraPaths, lib: Path, java: str, *, clock: Clock, secure: bool) -> KafkaServer:
    run_dir = paths.server_dir(NAME)
    remove_tree(run_dir)
    port, controller_port = free_port(), free_port()
    while controller_port == port:
        controller_port = free_port()
    try:
        return _launch(paths, lib, java, port=port, controller_port=controller_port,
                       cluster_id=new_cluster_id(), format_storage=True, clock=clock, secure=secure)
    except InfraError:
        # Nothing of value was stored yet; keep the logs, forget the rest.
        paths.state_file(NAME).unlink(missing_ok=True)
        remove_tree(run_dir / "data")
        raise


def _launch(paths: InfraPaths, lib: Path, java: str, *, port: int, controller_port: int,
            cluster_id: str, format_storage: bool, clock: Clock, secure: bool = False) -> KafkaServer:
    run_dir = paths.server_dir(NAME)
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "server.properties"
    security = prepare(paths.run) if secure else None
    write_private(config, kafka_properties(port=port, controller_port=controller_port, data_dir=data_dir,
                                           security=security, extra=extra_properties(paths.run)))
    log4j = run_dir / "log4j2.properties"
    log4j.write_text(LOG4J2_PROPERTIES)
    jvm = [java, *JVM_HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true",
           f"-Dlog4j2.configurationFile=file:{log4j}", f"-Dkafka.logs.dir={run_dir}",
           "-cp", f"{lib}/*"]
    if format_storage:
        _format(jvm, cluster_id, config, run_dir / "format.log",
                extra=scram_args(security) if security is not None else [])
    log = run_dir / "kafka.log"
    keep_previous(log)
    pid = spawn([*jvm, "kafka.Kafka", str(config)], log=log, cwd=run_dir)
    server = KafkaServer(pid=pid, port=port, controller_port=controller_port,
                         run_dir=str(run_dir), cluster_id=cluster_id, secure=secure)
    write_private(paths.state_file(NAME), json.dumps(asdict(server), indent=2) + "\n")
    try:
        wait_for(lambda: _ready_or_bind_failure(server), what="kafka", timeout=READY_TIMEOUT_S,
                 alive=lambda: is_running(pid, server.marker), log=server.log, clock=clock,
                 interval=0.25, pid=pid)
    except InfraError:
        stop_group(pid, server.marker)
        raise
    return server


def _format(jvm: list[str], cluster_id: str, config: Path, format_log: Path, *, extra: list[str]) -> None:
    # The tool's arguments go in a Java @argfile: SCRAM passwords must not be on a command line.
    argfile = write_argfile(config.with_name(".format.args"),
                            ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config), *extra])
    try:
        with open(format_log, "wb") as out:
            formatted = subprocess.run(
                [*jvm, f"@{argfile}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=180,
            )
    except subprocess.TimeoutExpired:
        raise InfraError(f"kafka storage format timed out after 180s (log: {format_log})",
                         retriable=True) from None
    finally:
        argfile.unlink(missing_ok=True)
    if formatted.returncode != 0:
        raise InfraError(f"kafka storage format failed: {log_tail(format_log)} (log: {format_log})")


def _ready_or_bind_failure(server: KafkaServer) -> bool:
    # A broker whose port was taken after free_port() chose it may hang instead of exiting.
    if "Address already in use" in server.log.read_text(errors="replace"):
        raise InfraError(f"kafka: Address already in use (log: {server.log})", retriable=True)
    return kafka_healthy(server, timeout=3.0)


def _metadata_lists_broker(bootstrap: str, timeout: float, security: KafkaSecurity | None = None) -> bool:
    # aiokafka is async; run it on a private loop in a worker thread so this works whether
    # or not the caller is inside an event loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            request = _metadata_request(bootstrap, timeout_s=timeout, security=security)
            return pool.submit(asyncio.run, request).result(timeout + 5)
        except Exception:
            return False


async def _metadata_request(bootstrap: str, *, timeout_s: float, security: KafkaSecurity | None) -> bool:
    from aiokafka.client import AIOKafkaClient

    from shared.bus.kafka_login import security_options

    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a broker still starting refuses; that is expected here
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                            **(security_options(security) if security is not None else {}))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return bool(client.cluster.brokers())
    finally:
        await client.close()
        quiet.setLevel(level)


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
