"""A node's or user's own logins, taken from its credential when nothing else names one.

An agent and a user's ``hadar`` hold a credential (``HADAR_IDENTITY_FILE``) that carries
their logins' secrets (:class:`shared.security.identities.Credential`). :func:`own_login_env`
fills them into the settings environment: the Kafka login (``hadar-node-<id>`` /
``hadar-user-<name>``) when the environment asks for SASL but names no user, the store login
(the same name) when it names an S3 endpoint but no access key. A login given in the
environment always wins (a development store's root, an operator's own), so a deployment
that never enrolled anyone is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.errors import ConfigError
from shared.security.authorship import IDENTITY_ENV
from shared.security.identities import Credential
from shared.security.principals import login_of

__all__ = ["own_login_env"]



def own_login_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the credential's logins filled in (module docstring); ConfigError when a
    login is needed and the credential cannot be read or carries none."""
    out = dict(env)
    sasl = env.get("HADAR_KAFKA_SECURITY_PROTOCOL", "").strip().upper().startswith("SASL")
    kafka = sasl and not env.get("HADAR_KAFKA_USERNAME", "").strip()
    store = bool(env.get("HADAR_S3_ENDPOINT", "").strip()) and not any(
        env.get(name, "").strip() for name in ("HADAR_S3_ACCESS_KEY", "HADAR_S3_ACCESS_KEY_FILE"))
    if not (kafka or store) or not env.get(IDENTITY_ENV, "").strip():
        return out
    credential = Credential.read(env[IDENTITY_ENV])
    login = login_of(credential.identity)
    if kafka:
        if not credential.kafka_password:
            raise ConfigError(f"{IDENTITY_ENV}: the credential of {credential.identity} carries no Kafka login; "
                              "enrol it again with the master key, or set HADAR_KAFKA_USERNAME")
        out["HADAR_KAFKA_USERNAME"], out["HADAR_KAFKA_PASSWORD"] = login, credential.kafka_password
        out.pop("HADAR_KAFKA_PASSWORD_FILE", None)
    if store:
        if not credential.store_secret:
            raise ConfigError(f"{IDENTITY_ENV}: the credential of {credential.identity} carries no store login; "
                              "enrol it again with the master key (a user may add the admin's logins file: "
                              "hadar identity add-logins), or set HADAR_S3_ACCESS_KEY")
        out["HADAR_S3_ACCESS_KEY"], out["HADAR_S3_SECRET_KEY"] = login, credential.store_secret
        out.pop("HADAR_S3_SECRET_KEY_FILE", None)
    return out
