"""`redis_connection` in one process: URLs shown masked, where the password comes
from, the password and TLS files, the flags, and texts that never carry the password
(the programs against real servers: `test_redis_credentials`)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import redis
from absl import flags as absl_flags
from conftest import throwaway_password
from test_redis_credentials import _assert_nowhere, _password_file, _quoted

from official.utils.flags import core
from recommendation.online.sources import redis_connection, redis_source
from recommendation.online.sources.redis_connection import RedisAccessError, RedisOptions


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://trainer:s3cret@host:6379/0", "redis://trainer:***@host:6379/0"),
        ("rediss://trainer:p%40ss%2Fword@host:6380/2", "rediss://trainer:***@host:6380/2"),
        ("redis://:p@ss@host/0", "redis://:***@host/0"),
        ("redis://host:6379/0?password=s3cret&db=1", "redis://host:6379/0?password=***&db=1"),
        ("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***"),
        ("redis://trainer@host:6379/0", "redis://trainer@host:6379/0"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://:s3cret@[::1/0", "redis://***"),  # does not parse: all of it masked
    ],
)
def test_a_url_is_shown_with_its_password_masked(url, shown):
    assert redis_connection.mask_url(url) == shown


def _resolve(tmp_path, caplog, url="redis://host:6379/0", environ=None, **options):
    with caplog.at_level("WARNING"):
        access = redis_connection.resolve(RedisOptions(url=url, **options), environ or {})
    return access, _warnings(caplog)


def _warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "absl"]


def test_the_password_comes_from_the_url_then_the_file_then_the_environment(tmp_path, caplog):
    in_file = _password_file(tmp_path / "pw", "from-file")
    environ = {"REDIS_PASSWORD": "from-env", "REDIS_USERNAME": "env-user"}

    access, warnings = _resolve(tmp_path, caplog, environ=environ)
    assert (access.username, access.password, access.password_from) == (
        "env-user",
        "from-env",
        "REDIS_PASSWORD",
    )
    assert warnings == []
    caplog.clear()

    access, warnings = _resolve(tmp_path, caplog, environ=environ, password_file=in_file)
    assert (access.password, access.password_from) == (
        "from-file",
        f"--redis_password_file {in_file}",
    )
    assert warnings == [
        f"REDIS_PASSWORD is ignored: the password comes from --redis_password_file {in_file}"
    ]
    caplog.clear()

    access, warnings = _resolve(tmp_path, caplog, "redis://me:from-url@host/0", environ)
    assert (access.username, access.password, access.password_from) == (
        "me",
        "from-url",
        "--redis_url",
    )
    assert access.shown == "redis://me:***@host/0"
    assert warnings == [
        "the Redis password in --redis_url can be read by every user of this machine (ps) "
        "and stays in the shell's history: give it in REDIS_PASSWORD or --redis_password_file",
        "REDIS_PASSWORD is ignored: the password comes from --redis_url",
        "REDIS_USERNAME is ignored: the user name comes from --redis_url",
    ]
    caplog.clear()

    access, _ = _resolve(tmp_path, caplog)
    assert (access.username, access.password, access.password_from) == (None, None, None)


def test_the_password_never_shows_in_a_repr_or_a_scrubbed_text(tmp_path, caplog):
    password = throwaway_password()
    access, _ = _resolve(tmp_path, caplog, f"redis://u:{_quoted(password)}@host:1/0")
    assert password in access.client().connection_pool.connection_kwargs["password"]
    text = f"{access!r} {RedisOptions(url=access.url)!r}"
    text += access.scrub(f"{access.url} said {password!r} ({_quoted(password)})")
    text += redis_connection.error_text(redis.ConnectionError(password), access.client())
    assert "***" in text
    _assert_nowhere([password], [text])


def test_a_password_file_others_can_read_is_named_with_the_fix(tmp_path, caplog):
    path = _password_file(tmp_path / "pw", "s3cret", mode=0o644)
    access, warnings = _resolve(tmp_path, caplog, password_file=path)
    assert access.password == "s3cret"  # the newline at its end is not part of it
    assert warnings == [
        f"--redis_password_file {path} can be read by other users (mode 644): chmod 600 {path}"
    ]


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda path: None,
            "cannot read --redis_password_file {path} (No such file or directory): "
            "pass a file that holds the Redis password, readable by this user",
        ),
        (
            lambda path: _password_file(path, ""),
            "--redis_password_file {path} is empty: write the Redis password in it",
        ),
    ],
)
def test_a_password_file_that_gives_no_password_is_one_message(tmp_path, caplog, make, message):
    path = tmp_path / "pw"
    make(path)
    with pytest.raises(RedisAccessError) as error:
        _resolve(tmp_path, caplog, password_file=str(path))
    assert str(error.value) == message.format(path=path)


def test_a_tls_file_that_cannot_be_loaded_is_named_by_its_flag(tmp_path, caplog):
    with pytest.raises(RedisAccessError) as error:
        _resolve(tmp_path, caplog, "rediss://host/0", ca_file=str(tmp_path / "ca.pem"))
    assert str(error.value) == (
        f"cannot use --redis_ca_file {tmp_path / 'ca.pem'} (No such file or directory): pass "
        "the CA certificate (PEM) that signed the server's"
    )
    (tmp_path / "cert.pem").write_text("not a certificate")
    with pytest.raises(
        RedisAccessError, match=r"cannot use --redis_cert_file .* with --redis_key_file"
    ):
        _resolve(
            tmp_path,
            caplog,
            "rediss://host/0",
            cert_file=str(tmp_path / "cert.pem"),
            key_file=str(tmp_path / "cert.pem"),
        )


def _parse(*args: str) -> RedisOptions:
    flag_values = absl_flags.FlagValues()
    core.define_flags(redis_connection.REDIS_FLAGS, RedisOptions(), flag_values)
    flag_values(["program", *args])
    return core.config_from_flags(redis_connection.REDIS_FLAGS, RedisOptions(), flag_values)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--redis_url=http://h/0"],
            "--redis_url must start with redis://, rediss:// (TLS) or unix://",
        ),
        (
            ["--redis_url=redis://:pw@h/0", "--redis_password_file=/pw"],
            "give the Redis password once: in --redis_password_file, not also in --redis_url",
        ),
        (
            ["--redis_url=redis://h/0", "--redis_ca_file=/ca.pem"],
            "--redis_ca_file, --redis_cert_file and --redis_key_file are for TLS: give a "
            "rediss:// --redis_url",
        ),
        (
            ["--redis_url=rediss://h/0", "--redis_cert_file=/c.pem"],
            "give --redis_cert_file and --redis_key_file together",
        ),
    ],
)
def test_bad_redis_flags_are_rejected(args, message):
    with pytest.raises(absl_flags.IllegalFlagValueError, match=re.escape(message)):
        _parse(*args)


def test_the_flags_set_the_options():
    assert _parse(
        "--redis_url=rediss://h/0",
        "--redis_password_file=/pw",
        "--redis_ca_file=/ca",
        "--redis_cert_file=/c",
        "--redis_key_file=/k",
    ) == RedisOptions("rediss://h/0", "/pw", "/ca", "/c", "/k")


def test_a_reconnection_warning_never_carries_the_password(caplog):
    password = throwaway_password()
    source = redis_source.RedisSource(redis.Redis(password=password), "events", max_backoff=0.0)
    with caplog.at_level("WARNING"):
        source._wait_to_reconnect(redis.ConnectionError(f"closed while sending {password}"))
    assert _warnings(caplog) == ["redis unavailable (closed while sending ***); retrying in 0.00 s"]


@pytest.mark.parametrize(
    "cert, reason, fix",
    [
        (
            None,
            "Error 8 while writing to socket. EOF occurred in violation of protocol (_ssl.c:2427).",
            "if it asks for a client certificate, pass --redis_cert_file and --redis_key_file",
        ),
        (
            "/c.pem",
            "Error while reading from h:6380 : (104, 'Connection reset by peer')",
            "check that it trusts the CA of --redis_cert_file /c.pem",
        ),
    ],
)
def test_a_tls_connection_the_server_closed_says_what_it_may_want(
    tmp_path, caplog, cert, reason, fix
):
    """A refusing server's alert is lost where the client writes first and the server
    has closed: the message says what a TLS server usually refuses."""
    access, _ = _resolve(tmp_path, caplog, "rediss://h:6380/0")
    access = dataclasses.replace(access, options=RedisOptions(cert_file=cert))
    message = access.explain(redis.ConnectionError(reason), rules="")
    assert message == f"Redis at rediss://h:6380/0 closed the TLS connection ({reason}): {fix}"
