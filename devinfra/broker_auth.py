"""The secured development broker's extra pieces: a SASL_SSL listener, SCRAM users made at
format time, and the KRaft StandardAuthorizer (used by :mod:`devinfra.kafka`).

Layout under ``<run>/secure/``: ``secrets.json`` (every principal's password, 0600),
``tls/ca.pem`` (the CA clients trust), ``tls/ca.key`` and ``tls/server.pem`` (0600).

* The client listener is ``SASL_SSL`` with SCRAM-SHA-512 only; the controller listener
  stays PLAINTEXT on 127.0.0.1 (a single combined node talks to itself there), and its
  principal ``User:ANONYMOUS`` is a super user together with ``User:admin``.
  ``allow.everyone.if.no.acl.found=false``: what no ACL allows is refused.
* Every client connection authenticates again each :data:`REAUTH_MS`
  (``connections.max.reauth.ms``): aiokafka cannot re-authenticate in place (KIP-368), so
  the broker closes the connection at its next request after that and the client logs in
  anew. A revoked node's or user's connection that was open before the revocation is so cut
  within :data:`REAUTH_MS`; the cost is one reconnect per connection per window.
* Secrets never appear on a command line: the admin's SCRAM user is passed to ``StorageTool``
  in a Java ``@argfile`` (0600, deleted after use), and the broker's own login is in
  ``server.properties`` (0600).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from shared.bus.settings import KafkaSecurity
from shared.security.credentials import MECHANISM, Secrets, load_or_create
from shared.security.files import write_private
from shared.security.principals import ADMIN

__all__ = ["BrokerSecurity", "prepare", "secure_dir", "listener_properties", "scram_args", "admin_security",
           "REAUTH_MS"]

TLS_HOSTS = ("127.0.0.1", "localhost")
REAUTH_MS = 300_000   # at most this long does a revoked login's open connection last


def secure_dir(run: Path) -> Path:
    """Where a run directory keeps its secured setup."""
    return run / "secure"


@dataclass(frozen=True, kw_only=True)
class BrokerSecurity:
    """What the broker needs to run secured."""

    secrets: Secrets
    ca_file: Path
    server_pem: Path


def prepare(run: Path, *, now: dt.datetime | None = None) -> BrokerSecurity:
    """The run directory's secrets and certificates, made on first use and kept after."""
    base = secure_dir(run)
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o700)
    found = load_or_create(base / "secrets.json")
    tls = base / "tls"
    if not (tls / "server.pem").exists():
        from shared.security.tls import make_tls  # cryptography only where a CA is made
        make_tls(tls, hosts=TLS_HOSTS, now=now or dt.datetime.now(dt.UTC))
    return BrokerSecurity(secrets=found, ca_file=tls / "ca.pem", server_pem=tls / "server.pem")


def listener_properties(security: BrokerSecurity, *, port: int, controller_port: int) -> dict[str, str]:
    """``server.properties`` entries that replace the PLAINTEXT client listener."""
    admin_password = security.secrets.kafka[ADMIN]
    return {
        "listeners": f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL",
        "inter.broker.listener.name": "SASL_SSL",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" '
            f'password="{admin_password}";',
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(security.server_pem),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(security.ca_file),
        "ssl.endpoint.identification.algorithm": "https",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{ADMIN};User:ANONYMOUS",
        "allow.everyone.if.no.acl.found": "false",
        "connections.max.reauth.ms": str(REAUTH_MS),
    }


def scram_args(security: BrokerSecurity) -> list[str]:
    """``--add-scram`` arguments for StorageTool: the admin user only. The services' users
    are made by :func:`shared.security.provision.secure_kafka`, as in the stack."""
    return ["--add-scram", f'{MECHANISM}=[name={ADMIN},password={security.secrets.kafka[ADMIN]}]']


def write_argfile(path: Path, args: list[str]) -> Path:
    """A Java launcher ``@argfile`` (0600) holding ``args``, one quoted per line."""
    def quote(arg: str) -> str:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    write_private(path, "\n".join(quote(a) for a in args) + "\n")
    os.chmod(path, 0o600)
    return path


def admin_security(run: Path) -> KafkaSecurity:
    """The admin's client settings for the secured broker of ``run`` (for health checks and setup)."""
    security = prepare(run)
    return KafkaSecurity(protocol="SASL_SSL", mechanism=MECHANISM, username=ADMIN,
                         password=security.secrets.kafka[ADMIN], ca_file=str(security.ca_file))
