"""Redis credentials stay secret: ncf-online and scripts/replay_events.py given a
password every way there is (the URL, a file, the environment; right, wrong, missing,
the server down, changed while training), an ACL user without the trainer's rights,
and rediss:// through a real TLS server; the password is in nothing they print or
write, and each failure is one error line saying what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.parse

import pytest
import tensorflow as tf
from conftest import ROOT, the_error_line, throwaway_password, write_movielens
from test_online_main import _events, _finish, _lines, _Publisher, _start, _wait_for

SCRIPT = os.path.join(ROOT, "scripts", "replay_events.py")
EVENTS = 256
# What the trainer runs with here: seconds, not minutes.
TRAINER_FLAGS = ["--checkpoint_every_steps=2", "--export_every_steps=2", "--idle_timeout_secs=2"]
WRONG_PASSWORD = "wrong:" + throwaway_password()


def _env(**values: str) -> dict[str, str]:
    """This environment without its Redis credentials, with `values` and the checkout
    on the path."""
    clean = {k: v for k, v in os.environ.items() if k not in ("REDIS_PASSWORD", "REDIS_USERNAME")}
    return {**clean, "PYTHONPATH": ROOT, **values}


def _quoted(password: str) -> str:
    return urllib.parse.quote(password, safe="")


def _password_file(path, password: str, mode: int = 0o600) -> str:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as out:
        out.write(password + "\n")
    os.chmod(path, mode)  # whatever the umask
    return str(path)


def _replay(tmp_path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    ratings = tmp_path / "ratings.dat"
    if not ratings.exists():
        write_movielens(str(ratings), _events(EVENTS, seed=0).tolist(), "dat")
    return subprocess.run(
        [sys.executable, SCRIPT, f"--ratings={ratings}", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _trainer(tmp_path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "recommendation.online_main",
            f"--model_dir={tmp_path / 'm'}",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_nowhere(passwords: list[str], texts: list[str], folders=()) -> None:
    """No form of any of `passwords` (as it is, URL-quoted) in `texts` or in the bytes
    of any file under `folders` (or the file itself)."""
    forms = {form for password in passwords for form in (password, _quoted(password))}
    found = [f"text {index}" for index, text in enumerate(texts) if any(f in text for f in forms)]
    for folder in folders:
        paths = [str(folder)] if os.path.isfile(folder) else []
        for directory, _, names in os.walk(folder):
            paths += [os.path.join(directory, name) for name in names]
        assert paths, f"nothing written in {folder}"
        for path in paths:
            with open(path, "rb") as stream:
                data = stream.read()
            found += [path for form in forms if form.encode() in data]
    assert not found, f"the password is in {found}"


# ---------------------------------------------------------------------------
# The programs against a Redis that wants a password


def test_a_trainer_and_a_replay_given_the_password_without_the_command_line_keep_it_secret(
    redis_server_with_password, tmp_path
):
    """The replay from REDIS_PASSWORD (and, with a warning, from the URL), the trainer
    from --redis_password_file: all work, and the password is in nothing they print or
    write (the model_dir with its checkpoints and TensorBoard events, the exports, the
    summary, the audit log)."""
    server, password = redis_server_with_password, redis_server_with_password.password
    server.client().xadd("events", {"user": 1, "item": 2})  # a dead letter
    in_url = f"redis://:{_quoted(password)}@127.0.0.1:{server.port}/0"
    first = _replay(tmp_path, f"--redis_url={in_url}", "--limit=1", env=_env())
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.endswith(f"events/s) to redis://:***@127.0.0.1:{server.port}/0\n")
    assert (
        "the Redis password in --redis_url can be read by every user of this machine (ps) and "
        "stays in the shell's history: give it in REDIS_PASSWORD or --redis_password_file"
    ) in first.stderr
    rest = _replay(
        tmp_path, f"--redis_url={server.url}", "--skip=1", env=_env(REDIS_PASSWORD=password)
    )
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert rest.stdout.endswith(f"events/s) to {server.url}\n")
    model_dir, export_dir = tmp_path / "model", tmp_path / "export"
    summary, audit = tmp_path / "summary.json", tmp_path / "audit.txt"
    trainer, out = _start(
        tmp_path,
        "trainer",
        f"--redis_url={server.url}",
        f"--redis_password_file={_password_file(tmp_path / 'pw', password)}",
        f"--model_dir={model_dir}",
        f"--export_dir={export_dir}",
        f"--summary_file={summary}",
        f"--trained_events_log={audit}",
        *TRAINER_FLAGS,
        env=_env(),
    )
    text = _finish(trainer, out, tmp_path, "trainer")
    errors = open(tmp_path / "trainer.err").read()
    assert f"online: {EVENTS} events" in text and "dead letters 1" in text
    assert f"reading stream 'events' of Redis at {server.url}" in errors
    assert server.client().xpending("events", "trainer")["pending"] == 0
    assert tf.io.gfile.glob(str(model_dir / "events.out.tfevents.*"))
    dead = [fields for _, fields in server.client().xrange("events:dead")]
    _assert_nowhere(
        [password],
        [first.stdout, first.stderr, rest.stdout, rest.stderr, text, errors, repr(dead)],
        [model_dir, export_dir, summary, audit],
    )


# Each way a password goes wrong: the flags and environment of the case (given the
# server, the right password and a password file's path) and the error line (given the
# server's port and that path). The URL is the server's, without a password, unless the
# case gives one.
PASSWORD_FAILURES = {
    "wrong in REDIS_PASSWORD": (
        lambda server, password, path: ([], {"REDIS_PASSWORD": WRONG_PASSWORD}),
        "error: Redis at redis://127.0.0.1:{port}/0 refused the password from REDIS_PASSWORD "
        "(invalid username-password pair or user is disabled.): set REDIS_PASSWORD to the "
        "right one",
    ),
    "wrong in the file": (
        lambda server, password, path: (
            [f"--redis_password_file={_password_file(path, WRONG_PASSWORD)}"],
            {"REDIS_PASSWORD": password},  # ignored: the file comes first
        ),
        "error: Redis at redis://127.0.0.1:{port}/0 refused the password from "
        "--redis_password_file {path} (invalid username-password pair or user is disabled.): "
        "write the right one in {path}",
    ),
    "wrong in the URL": (
        lambda server, password, path: (
            [f"--redis_url=redis://:{_quoted(WRONG_PASSWORD)}@127.0.0.1:{server.port}/0"],
            {},
        ),
        "error: Redis at redis://:***@127.0.0.1:{port}/0 refused the password from "
        "--redis_url (invalid username-password pair or user is disabled.): give the right "
        "one in REDIS_PASSWORD or --redis_password_file",
    ),
    "missing": (
        lambda server, password, path: ([], {}),
        "error: Redis at redis://127.0.0.1:{port}/0 wants a password (HELLO must be called "
        "with the client already authenticated, otherwise the HELLO AUTH <user> <pass> option "
        "can be used to authenticate the client and select the RESP protocol version at the "
        "same time): set REDIS_PASSWORD or pass --redis_password_file (a file only this user "
        "can read)",
    ),
    "no password file": (
        lambda server, password, path: ([f"--redis_password_file={path}"], {}),
        "error: cannot read --redis_password_file {path} (No such file or directory): pass a "
        "file that holds the Redis password, readable by this user",
    ),
    "right in the URL, Redis down": (
        lambda server, password, path: (
            [f"--redis_url=redis://:{_quoted(password)}@127.0.0.1:{server.port}/0"],
            {},
        ),
        "error: cannot reach Redis at redis://:***@127.0.0.1:{port}/0 (Error 111 connecting to "
        "127.0.0.1:{port}. Connection refused.): start redis-server or fix --redis_url",
    ),
}


@pytest.mark.parametrize("program", ["trainer", "replay"])
@pytest.mark.parametrize("case", list(PASSWORD_FAILURES))
def test_each_way_a_password_goes_wrong_is_one_error_line_without_it(
    redis_server_with_password, tmp_path, program, case
):
    server, password = redis_server_with_password, redis_server_with_password.password
    make, expected = PASSWORD_FAILURES[case]
    path = tmp_path / "pw"
    flags, environ = make(server, password, path)
    if case.endswith("Redis down"):
        server.kill()
    if not any(flag.startswith("--redis_url=") for flag in flags):
        flags.append(f"--redis_url={server.url}")
    run = _trainer if program == "trainer" else _replay
    result = run(tmp_path, *flags, env=_env(**environ))
    assert the_error_line(result) == expected.format(port=server.port, path=path)
    _assert_nowhere([password, WRONG_PASSWORD], [result.stdout, result.stderr])


@pytest.mark.integration
@pytest.mark.parametrize("program", ["trainer", "replay"])
def test_a_flag_error_shows_the_url_with_its_password_masked(tmp_path, program):
    password = throwaway_password()
    url = f"redis://:{_quoted(password)}@127.0.0.1:1/0"
    run = _trainer if program == "trainer" else _replay
    result = run(tmp_path, f"--redis_url={url}", f"--events_dir={tmp_path}", env=_env())
    assert result.returncode == 1
    assert "redis_url=redis://:***@127.0.0.1:1/0, " in result.stderr
    assert f"events_dir={tmp_path}" in result.stderr
    _assert_nowhere([password], [result.stdout, result.stderr])


def test_a_password_changed_while_training_stops_the_trainer_with_one_error_line(
    redis_server_with_password, tmp_path
):
    """Retrying a refused password cannot heal: the trainer stops (its last checkpoint
    stays where the same command resumes) instead of retrying in a loop."""
    server, password = redis_server_with_password, redis_server_with_password.password
    _Publisher(server, _events(EVENTS, seed=1), rate=1e6).run()
    model_dir, audit = tmp_path / "model", tmp_path / "audit.txt"
    trainer, _ = _start(
        tmp_path,
        "trainer",
        f"--redis_url={server.url}",
        f"--model_dir={model_dir}",
        f"--trained_events_log={audit}",
        "--checkpoint_every_steps=1",
        env=_env(REDIS_PASSWORD=password),
    )
    _wait_for(
        lambda: len(_lines(audit)) == EVENTS and tf.train.latest_checkpoint(str(model_dir)),
        what="every event trained and a checkpoint",
        process=trainer,
    )
    admin = server.client()
    admin.config_set("requirepass", WRONG_PASSWORD)
    admin.client_kill_filter(_type="normal", skipme=True)  # as a server restart would
    trainer.wait(timeout=120)
    result = subprocess.CompletedProcess(
        trainer.args,
        trainer.returncode,
        open(tmp_path / "trainer.out").read(),
        open(tmp_path / "trainer.err").read(),
    )
    assert the_error_line(result) == (
        f"error: Redis at {server.url} refused the password from REDIS_PASSWORD (invalid "
        "username-password pair or user is disabled.): set REDIS_PASSWORD to the right one; "
        "training stopped, and the same command resumes from the last checkpoint"
    )
    assert tf.train.latest_checkpoint(str(model_dir))
    _assert_nowhere([password, WRONG_PASSWORD], [result.stdout, result.stderr], [model_dir])


def test_a_user_without_the_trainers_rights_is_told_the_acl_rules_that_are_enough(
    redis_server_with_password, tmp_path
):
    """The rules the error line gives, applied as they are, let the trainer do all it
    does: read, dead-letter, acknowledge, check for trimmed entries."""
    server = redis_server_with_password
    user_password = throwaway_password()
    admin = server.client()
    admin.acl_setuser("trainer", enabled=True, passwords=[f"+{user_password}"])
    env = _env(REDIS_USERNAME="trainer", REDIS_PASSWORD=user_password)
    flags = [f"--redis_url={server.url}", *TRAINER_FLAGS]
    refused = _trainer(tmp_path, *flags, env=env)
    line = the_error_line(refused)
    assert line == (
        f"error: Redis at {server.url} refused user trainer a command or key this program uses "
        "(this user has no permissions to run the 'ping' command or its subcommand): allow "
        "them with ACL SETUSER trainer +ping +xgroup|create +xreadgroup +xack +xinfo|groups "
        "+xinfo|stream +xrange +xpending +xadd +multi +exec +get +set +watch +unwatch ~events "
        "~events:dead ~events:claim:trainer"
    )
    admin.execute_command("ACL", "SETUSER", *line.partition("ACL SETUSER ")[2].split())
    admin.xadd("events", {"user": 1, "item": 2})  # a dead letter
    _Publisher(server, _events(EVENTS, seed=2), rate=1e6).run()
    trainer, out = _start(tmp_path, "trainer", *flags, f"--model_dir={tmp_path / 'm'}", env=env)
    text = _finish(trainer, out, tmp_path, "trainer")
    assert f"online: {EVENTS} events" in text and "dead letters 1" in text
    assert admin.xpending("events", "trainer")["pending"] == 0
    _assert_nowhere([user_password, server.password], [refused.stderr, text])


# ---------------------------------------------------------------------------
# TLS (rediss://)


def _tls_flags(tls, cert: bool = True, ca_file: str | None = None) -> list[str]:
    flags = [f"--redis_ca_file={ca_file or tls.ca_file}"]
    return flags + (
        [f"--redis_cert_file={tls.cert_file}", f"--redis_key_file={tls.key_file}"] if cert else []
    )


def test_a_replay_and_a_trainer_reach_redis_over_tls_with_a_client_certificate(redis_tls, tmp_path):
    password = redis_tls.server.password
    env = _env(REDIS_PASSWORD=password)
    flags = [f"--redis_url={redis_tls.url}", *_tls_flags(redis_tls)]
    replayed = _replay(tmp_path, *flags, env=env)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert replayed.stdout.endswith(f"events/s) to {redis_tls.url}\n")
    trainer, out = _start(
        tmp_path, "trainer", *flags, f"--model_dir={tmp_path / 'm'}", *TRAINER_FLAGS, env=env
    )
    text = _finish(trainer, out, tmp_path, "trainer")
    assert f"online: {EVENTS} events" in text
    assert redis_tls.server.client().xpending("events", "trainer")["pending"] == 0
    _assert_nowhere([password], [replayed.stdout, replayed.stderr, text])


# A TLS handshake that fails: the flags of the case (given the `RedisTls`), the URL, and
# the error line (given the URL shown and the fixture).
TLS_FAILURES = {
    "a CA that signed nothing of it": (
        lambda tls: _tls_flags(tls, ca_file=tls.wrong_ca_file),
        lambda tls: tls.url,
        "error: Redis at {url} presented a TLS certificate that --redis_ca_file "
        "{tls.wrong_ca_file} cannot vouch for (certificate verify failed: self-signed "
        "certificate in certificate chain): pass --redis_ca_file with the CA certificate that "
        "signed the server's",
    ),
    "a host the certificate is not for": (
        lambda tls: _tls_flags(tls),
        lambda tls: f"rediss://127.0.0.1:{tls.port}/0",
        "error: the TLS certificate of Redis at {url} is not for 127.0.0.1 (certificate verify "
        "failed: IP address mismatch, certificate is not valid for '127.0.0.1'): connect by a "
        "name the certificate holds (in --redis_url), or give the server a certificate for "
        "127.0.0.1",
    ),
    "no client certificate": (
        lambda tls: _tls_flags(tls, cert=False),
        lambda tls: tls.url,
        "error: Redis at {url} asks for a TLS client certificate (tlsv13 alert certificate "
        "required): pass --redis_cert_file and --redis_key_file",
    ),
}


@pytest.mark.parametrize("case", list(TLS_FAILURES))
def test_a_tls_failure_is_one_error_line_naming_the_certificate_problem(redis_tls, tmp_path, case):
    flags, url, expected = TLS_FAILURES[case]
    env = _env(REDIS_PASSWORD=redis_tls.server.password)
    result = _trainer(tmp_path, f"--redis_url={url(redis_tls)}", *flags(redis_tls), env=env)
    assert the_error_line(result) == expected.format(url=url(redis_tls), tls=redis_tls)
