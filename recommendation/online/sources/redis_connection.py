"""How every program here reaches Redis: the options that say where it is and who the
program is (`RedisOptions`, set by `REDIS_FLAGS`), resolved with the environment into a
`RedisAccess`: the client, the URL as it may be shown, and redis-py's errors turned into
one line that says what is wrong and what to do.

A password is never printed: a URL is shown with it masked (``redis://:***@host:6379/0``,
`mask_url`), and any text from redis-py or absl is scrubbed of it before it is shown or
logged. It comes from, first found first:

1. the URL (``redis://[USER]:PASSWORD@HOST:PORT/DB``), which every user of the machine
   can read in ``ps`` and the shell keeps in its history (a warning says so);
2. ``--redis_password_file``, a local file this user alone should read (a warning
   names one that others can read; a newline at its end is not part of the password);
3. the environment, ``REDIS_PASSWORD``.

The URL and the file together are refused; the environment beside either is ignored,
with a warning. The user name (Redis 6 ACL users) is the URL's, else ``REDIS_USERNAME``.
A ``rediss://`` URL speaks TLS: the server's certificate is checked against
``--redis_ca_file`` (default: the system's CAs) and the host name in the URL, and
``--redis_cert_file`` / ``--redis_key_file`` are the client certificate for a server
that asks for one. The password and TLS files are local files (a secret is mounted or
written on the machine, and TLS reads only local files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping

import redis
from absl import flags, logging

from official.utils.flags.core import Check, FlagSpec, Rule
from official.utils.misc import errors
from recommendation.online.sources import credentials
from recommendation.online.sources.credentials import MASK, scrub

PASSWORD_ENV = "REDIS_PASSWORD"
USERNAME_ENV = "REDIS_USERNAME"
SCHEMES = ("redis", "rediss", "unix")


class RedisAccessError(Exception):
    """Redis cannot be used as configured; the message says why and what to do, and
    holds no password."""


@dataclasses.dataclass(frozen=True)
class RedisOptions:
    """Where Redis is and how to prove who this program is (`REDIS_FLAGS`).

    Attributes:
        url: ``redis://[USER[:PASSWORD]@]HOST:PORT/DB``, ``rediss://`` for TLS, or
            ``unix://PATH``; None: no Redis.
        password_file: A local file holding the password.
        ca_file: CA certificates that sign a TLS server's certificate (None: the system's).
        cert_file, key_file: A client certificate and its key, for a TLS server that
            asks for one.
    """

    url: str | None = dataclasses.field(default=None, repr=False)
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


def _split(url: str | None) -> urllib.parse.SplitResult | None:
    try:
        return urllib.parse.urlsplit(url) if url else None
    except ValueError:  # brackets that are no IPv6 address
        return None


def _url_password(url: str | None) -> str | None:
    """The password a URL holds, in its user part or a ``password=`` query (both are
    redis-py's), or None."""
    parts = _split(url)
    if parts is None:
        return None
    query = urllib.parse.parse_qs(parts.query).get("password")
    return query[0] if query else parts.password


def mask_url(url: str) -> str:
    """`url` with its password (user part or ``password=`` query) shown as ``***``."""
    parts = _split(url)
    if parts is None:
        return f"{url.partition('://')[0]}://{MASK}"
    netloc = parts.netloc
    if parts.password is not None:
        user_part, _, host = netloc.rpartition("@")
        netloc = f"{user_part.partition(':')[0]}:{MASK}@{host}"
    query = "&".join(
        f"{pair.partition('=')[0]}={MASK}" if pair.partition("=")[0] == "password" else pair
        for pair in parts.query.split("&")
    )
    # By hand: urlunsplit drops the empty host of unix:///path.
    shown = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
    return shown + (f"#{parts.fragment}" if parts.fragment else "")


def _tls_files(values: dict) -> list[str]:
    return [values[name] for name in ("redis_ca_file", "redis_cert_file", "redis_key_file")]


# The flags of every program that reaches Redis, on `RedisOptions`.
REDIS_FLAGS = (
    FlagSpec(
        "redis_url",
        "Redis: redis://[USER@]HOST:PORT/DB, or rediss://... for TLS; the password from "
        f"{PASSWORD_ENV} or --redis_password_file, not here (ps shows command lines).",
        field="url",
        checks=(
            Check(
                lambda url: url is None or url.partition("://")[0] in SCHEMES,
                "--{flag} must start with redis://, rediss:// (TLS) or unix://",
            ),
        ),
    ),
    FlagSpec(
        "redis_password_file",
        f"Local file holding the Redis password (mode 600); default: ${PASSWORD_ENV}.",
        field="password_file",
    ),
    FlagSpec(
        "redis_ca_file",
        "CA certificates (PEM) that sign the rediss:// server's certificate; default: "
        "the system's.",
        field="ca_file",
    ),
    FlagSpec(
        "redis_cert_file",
        "Client certificate (PEM) for a rediss:// server that asks for one.",
        field="cert_file",
    ),
    FlagSpec("redis_key_file", "The key of --redis_cert_file (PEM).", field="key_file"),
    Rule(
        ("redis_url", "redis_password_file"),
        lambda values: not (values["redis_password_file"] and _url_password(values["redis_url"])),
        "give the Redis password once: in --redis_password_file, not also in --redis_url",
    ),
    Rule(
        ("redis_url", "redis_ca_file", "redis_cert_file", "redis_key_file"),
        lambda values: (
            not any(_tls_files(values))
            or (values["redis_url"] or "").partition("://")[0] == "rediss"
        ),
        "--redis_ca_file, --redis_cert_file and --redis_key_file are for TLS: give a "
        "rediss:// --redis_url",
    ),
    Rule(
        ("redis_cert_file", "redis_key_file"),
        lambda values: bool(values["redis_cert_file"]) == bool(values["redis_key_file"]),
        "give --redis_cert_file and --redis_key_file together",
    ),
)


def _mask_redis_url(message: str) -> str:
    """`message` with --redis_url's password masked: absl's errors print the values of
    the flags that a failed check names."""
    url = flags.FLAGS["redis_url"].value
    return message.replace(url, mask_url(url)) if url else message


# absl's flag parsing for ``app.run``: one `error:` line, the Redis password masked.
parse_flags = errors.command_line_parser(scrub=_mask_redis_url)


def error_text(error: Exception, client: redis.Redis) -> str:
    """An error's text as it may be logged: without the password `client` connects with."""
    return scrub(str(error), client.connection_pool.connection_kwargs.get("password"))


class RefusedForMemory(Exception):
    """A command a source needs before it can go on was refused for memory: a write, or
    a MULTI of reads (Redis at maxmemory refuses a transaction whole); its argument
    names it, as `MemoryWait` says it."""


class MemoryWait:
    """Redis refusing writes for memory (``OOM command not allowed``: its used memory
    above ``maxmemory`` under a policy that evicts nothing, as streams need), waited
    out as an outage is: said once when it starts, with the setting and the fix, and
    once when the refused write succeeds again (`succeeded`); `seconds` sums the waits.

    Args:
        client: The client whose writes are refused (its address is named).
    """

    def __init__(self, client: redis.Redis) -> None:
        kwargs = client.connection_pool.connection_kwargs
        self.where = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        self.seconds = 0.0
        self.refusing: str | None = None  # what was refused, while it is
        self._since = 0.0

    def refused(self, what: str) -> None:
        """A write of `what` was refused for memory: said if it is the first."""
        if self.refusing is not None:
            return
        self.refusing, self._since = what, time.monotonic()
        logging.warning(
            "Redis at %s refuses writes for memory (%s: its used memory is above maxmemory "
            "and its maxmemory-policy evicts nothing): raise maxmemory (CONFIG SET "
            "maxmemory), cap the streams (XADD MAXLEN, XTRIM) or free memory; training goes "
            "on with what it can read, and the writes are retried until they succeed",
            self.where,
            what,
        )

    def succeeded(self, what: str) -> None:
        """A write of `what` succeeded: if it is what was refused, the wait is over."""
        if self.refusing != what:
            return
        waited = time.monotonic() - self._since
        self.seconds += waited
        self.refusing = None
        logging.info("Redis at %s accepts writes again, after %.1f s", self.where, waited)


def acl_rules(commands: Iterable[str], keys: Iterable[str]) -> str:
    """The ``ACL SETUSER`` rules that allow `commands` on `keys`."""
    return " ".join([*(f"+{command}" for command in commands), *(f"~{key}" for key in keys)])


@dataclasses.dataclass(frozen=True)
class RedisAccess:
    """A Redis as this program reaches it: the URL as given (`shown`: masked), the user
    and the password resolved (`resolve`), the TLS files. Its repr holds no password.

    Attributes:
        url: The URL as given (it may hold the password: never show it, show `shown`).
        shown: The URL with its password masked: the one to print and log.
        username: The ACL user (None: Redis's default user).
        password: The password (None: none given).
        password_from: Where the password came from, as a message names it.
        options: The TLS files (the rest of what the flags gave).
    """

    url: str = dataclasses.field(repr=False)
    shown: str
    username: str | None
    password: str | None = dataclasses.field(repr=False)
    password_from: str | None
    options: RedisOptions = dataclasses.field(repr=False)

    def client(self, **options) -> redis.Redis:
        """A client of this Redis (`options`: redis-py's, such as ``socket_timeout``)."""
        tls = {
            "ssl_ca_certs": self.options.ca_file,
            "ssl_certfile": self.options.cert_file,
            "ssl_keyfile": self.options.key_file,
        }
        options.update({name: value for name, value in tls.items() if value})
        return redis.Redis.from_url(
            self.url, username=self.username, password=self.password, **options
        )

    def scrub(self, text: str) -> str:
        """`text` without the password, and with the URL as given shown masked."""
        return scrub(text.replace(self.url, self.shown), self.password)

    @contextlib.contextmanager
    def errors_explained(self, rules: str) -> Iterator[None]:
        """Turns redis-py's errors into a `RedisAccessError` whose message is `explain`'s."""
        try:
            yield
        except redis.RedisError as error:
            raise RedisAccessError(self.explain(error, rules)) from None

    def explain(self, error: redis.RedisError, rules: str) -> str:
        """What went wrong and what to do, in one line without the password; `rules`
        are the ACL rules (`acl_rules`) the program needs, for a user refused a command."""
        reason = self.scrub(str(error))
        at = f"Redis at {self.shown}"
        if isinstance(error, redis.AuthenticationError) and self.password is None:
            return (
                f"{at} wants a password ({reason}): set {PASSWORD_ENV} or pass "
                "--redis_password_file (a file only this user can read)"
            )
        if isinstance(error, redis.AuthenticationError):
            if not self.username:
                return f"{at} refused the password from {self.password_from} ({reason}): " + (
                    self._password_fix()
                )
            return (
                f"{at} refused user {self.username} with the password from "
                f"{self.password_from} ({reason}): {self._password_fix()}, and check that "
                f"user {self.username} exists and is on (ACL LIST)"
            )
        if isinstance(error, redis.exceptions.NoPermissionError):
            user = self.username or "default"
            return (
                f"{at} refused user {user} a command or key this program uses ({reason}): "
                f"allow them with ACL SETUSER {user} {rules}"
            )
        if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
            return self._tls_problem(reason) or (
                f"cannot reach Redis at {self.shown} ({reason}): start redis-server or fix "
                "--redis_url"
            )
        return f"{at} answered an error: {reason}"

    def _password_fix(self) -> str:
        if self.password_from == PASSWORD_ENV:
            return f"set {PASSWORD_ENV} to the right one"
        if self.password_from == "--redis_url":
            return f"give the right one in {PASSWORD_ENV} or --redis_password_file"
        return f"write the right one in {self.options.password_file}"

    def _tls_problem(self, reason: str) -> str | None:
        """The message for a TLS handshake that failed, by OpenSSL's reason (None: the
        failure was no TLS one)."""
        detail, at = credentials.ssl_detail(reason), f"Redis at {self.shown}"
        if "CERTIFICATE_VERIFY_FAILED" in reason and "mismatch" in detail:
            host = urllib.parse.urlsplit(self.url).hostname
            return (
                f"the TLS certificate of {at} is not for {host} ({detail}): connect by a name "
                "the certificate holds (in --redis_url), or give the server a certificate "
                f"for {host}"
            )
        if "CERTIFICATE_VERIFY_FAILED" in reason:
            trusted = (
                f"--redis_ca_file {self.options.ca_file}"
                if self.options.ca_file
                else "the system's CA certificates"
            )
            return (
                f"{at} presented a TLS certificate that {trusted} cannot vouch for ({detail}): "
                "pass --redis_ca_file with the CA certificate that signed the server's"
            )
        if "CERTIFICATE_REQUIRED" in reason:
            return (
                f"{at} asks for a TLS client certificate ({detail}): pass --redis_cert_file "
                "and --redis_key_file"
            )
        if re.search(r"ALERT_(UNKNOWN_CA|BAD_CERTIFICATE|CERTIFICATE_UNKNOWN)", reason):
            return (
                f"{at} refused the TLS client certificate {self.options.cert_file} ({detail}): "
                "pass one signed by a CA that the server trusts"
            )
        # A server that refuses the handshake closes the connection: its alert is lost
        # where the client writes before it reads.
        closed = re.search(r"EOF occurred in violation|reset by peer|closed by server", reason)
        if closed and self.url.startswith("rediss:"):
            fix = (
                f"check that it trusts the CA of --redis_cert_file {self.options.cert_file}"
                if self.options.cert_file
                else "if it asks for a client certificate, pass --redis_cert_file and "
                "--redis_key_file"
            )
            return f"{at} closed the TLS connection ({detail}): {fix}"
        return None


def resolve(options: RedisOptions, environ: Mapping[str, str] = os.environ) -> RedisAccess:
    """The `RedisAccess` of `options` and the environment (module docstring: which
    password wins); the TLS files are loaded once here, so that a wrong one is named
    before any connection.

    Raises:
        RedisAccessError: The URL does not parse, or the password file or a TLS file
            cannot be read.
    """
    url, shown = options.url, mask_url(options.url)
    try:
        parsed = redis.connection.parse_url(url)
    except ValueError as error:
        raise RedisAccessError(
            f"--redis_url {shown} does not parse ({scrub(str(error), _url_password(url))}): "
            "write it as redis://[USER@]HOST:PORT/DB"
        ) from None
    password, password_from = parsed.get("password"), "--redis_url"
    if password is not None:
        logging.warning(
            "the Redis password in --redis_url can be read by every user of this machine "
            "(ps) and stays in the shell's history: give it in %s or --redis_password_file",
            PASSWORD_ENV,
        )
    elif options.password_file:
        password = credentials.read_password_file(
            options.password_file, "--redis_password_file", "Redis", RedisAccessError
        )
        password_from = f"--redis_password_file {options.password_file}"
    if password is not None and environ.get(PASSWORD_ENV):
        logging.warning("%s is ignored: the password comes from %s", PASSWORD_ENV, password_from)
    elif password is None and environ.get(PASSWORD_ENV):
        password, password_from = environ[PASSWORD_ENV], PASSWORD_ENV
    username = parsed.get("username") or environ.get(USERNAME_ENV) or None
    if parsed.get("username") and environ.get(USERNAME_ENV):
        logging.warning("%s is ignored: the user name comes from --redis_url", USERNAME_ENV)
    credentials.check_tls_files(
        options.ca_file, options.cert_file, options.key_file, "redis", RedisAccessError
    )
    return RedisAccess(
        url=url,
        shown=shown,
        username=username,
        password=password,
        password_from=password_from if password is not None else None,
        options=options,
    )
