"""How ncf-online reaches Kafka: the options that say where the brokers are and who the
trainer is (`KafkaOptions`, set by `KAFKA_FLAGS`), resolved with the environment into a
`KafkaAccess` (the client settings, the password masked in every text shown), and
librdkafka's errors turned into one line that says what is wrong and what to do.

The client (``confluent-kafka``, librdkafka's) is optional: `client_module` imports it
and says how to install it where it is missing, so that programs that never reach Kafka
do not need it.

Credentials follow `credentials`' rules, as Redis's do: a SASL login is
``--kafka_username`` (else ``NCF_KAFKA_USERNAME``) and a password from
``--kafka_password_file`` (a local file this user alone should read) or else from
``NCF_KAFKA_PASSWORD``; never from a flag's value, and never printed or logged (every
text from librdkafka is scrubbed of it). The file and the environment together: the
environment is ignored, with a warning. TLS is on with ``--kafka_tls`` or any TLS file:
the broker's certificate is checked against ``--kafka_ca_file`` (default: the system's
CAs), and ``--kafka_cert_file`` / ``--kafka_key_file`` are the client certificate for a
broker that asks for one.

librdkafka reconnects on its own; `BrokerWatch` (its error callback) says an outage once,
when it starts, counts it, and says when the brokers answer again, instead of a line per
attempt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from absl import logging

from official.utils.flags.core import FlagSpec, Rule
from recommendation.online.sources import credentials

PASSWORD_ENV = "NCF_KAFKA_PASSWORD"
USERNAME_ENV = "NCF_KAFKA_USERNAME"
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# librdkafka's names of the errors that mean no broker can be reached (now).
UNREACHABLE = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE", "_TIMED_OUT"})
# The errors that retrying cannot heal: a refused login, a TLS handshake that fails.
REFUSED = frozenset(
    {
        "_AUTHENTICATION",
        "SASL_AUTHENTICATION_FAILED",
        "_SSL",
        "TOPIC_AUTHORIZATION_FAILED",
        "GROUP_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
    }
)


class KafkaAccessError(Exception):
    """Kafka cannot be used as configured; the message says why and what to do, and
    holds no password."""


def client_module():
    """The ``confluent_kafka`` module.

    Raises:
        KafkaAccessError: It is not installed (the ``kafka`` extra).
    """
    try:
        import confluent_kafka
    except ImportError:
        raise KafkaAccessError(
            'the Kafka client is not installed: pip install ".[kafka]" (confluent-kafka)'
        ) from None
    return confluent_kafka


@dataclasses.dataclass(frozen=True)
class KafkaOptions:
    """Where the Kafka brokers are and how to prove who this program is (`KAFKA_FLAGS`).

    Attributes:
        servers: ``HOST:PORT[,HOST:PORT...]``, the bootstrap brokers; None: no Kafka.
        username: The SASL user (None: ``NCF_KAFKA_USERNAME``, else no SASL login).
        password_file: A local file holding the SASL password.
        sasl_mechanism: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``.
        tls: Speak TLS (also on where a TLS file is given).
        ca_file: CA certificates that sign the brokers' certificates (None: the system's).
        cert_file, key_file: A client certificate and its key, for brokers that ask.
    """

    servers: str | None = None
    username: str | None = None
    password_file: str | None = None
    sasl_mechanism: str = "PLAIN"
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


# The flags of every program that reaches Kafka, on `KafkaOptions`.
KAFKA_FLAGS = (
    FlagSpec(
        "kafka_servers",
        "Kafka: bootstrap brokers HOST:PORT[,HOST:PORT...]; the SASL password from "
        f"{PASSWORD_ENV} or --kafka_password_file (never a flag: ps shows command lines).",
        field="servers",
    ),
    FlagSpec("kafka_username", f"Kafka SASL user (default: ${USERNAME_ENV}).", field="username"),
    FlagSpec(
        "kafka_password_file",
        f"Local file holding the Kafka SASL password (mode 600); default: ${PASSWORD_ENV}.",
        field="password_file",
    ),
    FlagSpec(
        "kafka_sasl_mechanism",
        "SASL mechanism of --kafka_username.",
        field="sasl_mechanism",
        choices=SASL_MECHANISMS,
    ),
    FlagSpec("kafka_tls", "Speak TLS to the Kafka brokers.", field="tls"),
    FlagSpec(
        "kafka_ca_file",
        "CA certificates (PEM) that sign the Kafka brokers' certificates (TLS); default: "
        "the system's.",
        field="ca_file",
    ),
    FlagSpec(
        "kafka_cert_file",
        "Client certificate (PEM) for Kafka brokers that ask for one (TLS).",
        field="cert_file",
    ),
    FlagSpec("kafka_key_file", "The key of --kafka_cert_file (PEM).", field="key_file"),
    Rule(
        ("kafka_cert_file", "kafka_key_file"),
        lambda values: bool(values["kafka_cert_file"]) == bool(values["kafka_key_file"]),
        "give --kafka_cert_file and --kafka_key_file together",
    ),
)


class _LibrdkafkaLog:
    """librdkafka's own log lines (``logger`` setting), scrubbed, at verbosity 1: what
    matters of them reaches `BrokerWatch` as errors, said once."""

    def __init__(self, password: str | None) -> None:
        self.password = password

    def log(self, level: int, message: str, *args: Any) -> None:
        del level  # librdkafka logs every failed attempt as an error
        logging.vlog(1, "librdkafka: %s", credentials.scrub(message % args, self.password))


@dataclasses.dataclass(frozen=True)
class KafkaAccess:
    """Kafka as this program reaches it: the brokers, the user and the password resolved
    (`resolve`), the TLS files. Its repr holds no password.

    Attributes:
        servers: The bootstrap brokers.
        username: The SASL user (None: no SASL login).
        password: The SASL password (None: none given).
        password_from: Where the password came from, as a message names it.
        options: The rest of what the flags gave.
    """

    servers: str
    username: str | None
    password: str | None = dataclasses.field(repr=False)
    password_from: str | None
    options: KafkaOptions = dataclasses.field(repr=False)

    def settings(self, **more: Any) -> dict:
        """librdkafka settings of a client of these brokers (`more`: librdkafka's own,
        such as ``group.id``). They hold the password: never show them."""
        tls = self.options.tls or any(
            (self.options.ca_file, self.options.cert_file, self.options.key_file)
        )
        sasl = self.username is not None
        protocol = {(False, False): "PLAINTEXT", (True, False): "SSL"}.get(
            (tls, sasl), "SASL_SSL" if tls else "SASL_PLAINTEXT"
        )
        settings = {
            "bootstrap.servers": self.servers,
            "client.id": "ncf-online",
            "security.protocol": protocol,
            "logger": _LibrdkafkaLog(self.password),
        }
        if sasl:
            settings.update(
                {
                    "sasl.mechanism": self.options.sasl_mechanism,
                    "sasl.username": self.username,
                    "sasl.password": self.password or "",
                }
            )
        for name, value in (
            ("ssl.ca.location", self.options.ca_file),
            ("ssl.certificate.location", self.options.cert_file),
            ("ssl.key.location", self.options.key_file),
        ):
            if value:
                settings[name] = value
        return {**settings, **more}

    def scrub(self, text: str) -> str:
        """`text` without the password."""
        return credentials.scrub(text, self.password)

    def explain(self, error: Any, what: str) -> str:
        """What went wrong and what to do, in one line without the password, for a
        librdkafka `error` (a ``KafkaError``) met while `what` (``reading topic 'x'``)."""
        name, reason = error.name(), self.scrub(error.str())
        at = f"Kafka at {self.servers}"
        if name in UNREACHABLE:
            return (
                f"cannot reach {at} ({reason}): start the broker or fix --kafka_servers "
                f"(while {what})"
            )
        if name == "_SSL":
            return (
                f"the TLS handshake with {at} failed ({reason}): pass --kafka_ca_file with "
                "the CA certificate that signed the brokers', and --kafka_cert_file and "
                "--kafka_key_file if they ask for a client certificate"
            )
        if name in ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED"):
            if self.username is None:
                return (
                    f"{at} wants a SASL login ({reason}): pass --kafka_username and set "
                    f"{PASSWORD_ENV} or pass --kafka_password_file (a file only this user "
                    "can read)"
                )
            return (
                f"{at} refused user {self.username} with the password from "
                f"{self.password_from} ({reason}): {self._password_fix()}, and check the "
                f"user and --kafka_sasl_mechanism {self.options.sasl_mechanism}"
            )
        if name.endswith("_AUTHORIZATION_FAILED"):
            user = self.username or "the anonymous user"
            return (
                f"{at} refused {user} while {what} ({reason}): allow it with kafka-acls "
                "(Describe and Read on the topic, Read on the consumer group, Write on the "
                "claims and dead-letter topics)"
            )
        return f"{at} answered an error while {what}: {reason}"

    def _password_fix(self) -> str:
        if self.password_from == PASSWORD_ENV:
            return f"set {PASSWORD_ENV} to the right one"
        return f"write the right one in {self.options.password_file}"


def resolve(options: KafkaOptions, environ: Mapping[str, str] = os.environ) -> KafkaAccess:
    """The `KafkaAccess` of `options` and the environment (module docstring: which
    password wins); the TLS files are loaded once here, so that a wrong one is named
    before any connection.

    Raises:
        KafkaAccessError: The password file or a TLS file cannot be read, or a password
            is given without a user.
    """
    password, password_from = None, None
    if options.password_file:
        password = credentials.read_password_file(
            options.password_file, "--kafka_password_file", "Kafka", KafkaAccessError
        )
        password_from = f"--kafka_password_file {options.password_file}"
        if environ.get(PASSWORD_ENV):
            logging.warning(
                "%s is ignored: the password comes from %s", PASSWORD_ENV, password_from
            )
    elif environ.get(PASSWORD_ENV):
        password, password_from = environ[PASSWORD_ENV], PASSWORD_ENV
    username = options.username or environ.get(USERNAME_ENV) or None
    if password is not None and username is None:
        raise KafkaAccessError(
            f"a Kafka password is given ({password_from}) but no user: pass --kafka_username "
            f"or set {USERNAME_ENV}"
        )
    credentials.check_tls_files(
        options.ca_file, options.cert_file, options.key_file, "kafka", KafkaAccessError
    )
    return KafkaAccess(
        servers=options.servers,
        username=username,
        password=password,
        password_from=password_from,
        options=options,
    )


class BrokerWatch:
    """librdkafka's error callback (``error_cb``) of one client: an outage (every broker
    down) is said once and counted (`outages`), its end said by `answered` (called on a
    metadata request that succeeded); an error that retrying cannot heal is kept
    (`refused`) for the reader to raise. Before the brokers first answered, nothing is
    said: the error line at start-up says it.

    Args:
        access: The brokers (their errors' texts are scrubbed of its password).
    """

    def __init__(self, access: KafkaAccess) -> None:
        self.access = access
        self.outages = 0
        self.errors = 0  # every error met: a connection lost among them
        self.down = False
        self.answered_once = False
        self.last: Any = None  # the last error seen but "all brokers down", which says less
        self.refused: Any = None

    def __call__(self, error: Any) -> None:
        self.errors += 1
        if error.name() in REFUSED or error.fatal():
            self.refused = self.refused or error
        elif error.name() == "_ALL_BROKERS_DOWN":
            # Once per fall: librdkafka says it again only after a broker came back,
            # where each connection's failures (_TRANSPORT) come one per attempt.
            if self.answered_once and not self.down:
                self.outages += 1
                logging.warning(
                    "Kafka at %s unavailable (%s); reconnecting (said again once it answers)",
                    self.access.servers,
                    self.access.scrub((self.last or error).str()),
                )
            self.down = True
            return
        self.last = error

    def answered(self) -> None:
        """A request succeeded: an outage, if one was said, is over."""
        if self.down and self.answered_once:
            logging.info("Kafka at %s answers again", self.access.servers)
        self.down, self.answered_once = False, True
