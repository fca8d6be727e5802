"""What every connection to a broker (Redis, Kafka) shares about secrets: a password read
from a local file (`read_password_file`) and never shown (`scrub`: every text from a
client library or absl is masked before it is printed or logged), and TLS files loaded
once before connecting (`check_tls_files`), so that a wrong one is named by its flag
rather than found as a failed connection.

The rules are the same for every broker: a password comes from a file this user alone
should read (a warning names one that others can read; a newline at its end is not part
of the password) or from the environment, never from a flag's value, which every user
of the machine can read in ``ps``.
"""

from __future__ import annotations

import os
import re
import ssl
import stat
import urllib.parse

from absl import logging

MASK = "***"


def scrub(text: str, password: str | None) -> str:
    """`text` with `password` (as it is and URL-quoted) shown as ``***``."""
    if not password:
        return text
    for form in {password, urllib.parse.quote(password, safe=""), urllib.parse.quote(password)}:
        text = text.replace(form, MASK)
    return text


def read_password_file(path: str, flag: str, service: str, error: type[Exception]) -> str:
    """The password in `path` (without a newline at its end), given by `flag` for
    `service` (``Redis``, ``Kafka``); warns if others can read it.

    Raises:
        error: The file cannot be read, is not UTF-8 text, or is empty.
    """
    try:
        with open(path, encoding="utf-8") as stream:
            mode = os.fstat(stream.fileno()).st_mode
            password = stream.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as problem:
        reason = problem.strerror if isinstance(problem, OSError) else "not UTF-8 text"
        raise error(
            f"cannot read {flag} {path} ({reason}): pass a file that holds the {service} "
            "password, readable by this user"
        ) from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logging.warning(
            "%s %s can be read by other users (mode %o): chmod 600 %s",
            flag,
            path,
            stat.S_IMODE(mode),
            path,
        )
    if not password:
        raise error(f"{flag} {path} is empty: write the {service} password in it")
    return password


def ssl_detail(text: str) -> str:
    """OpenSSL's words in an error's text ("certificate verify failed: ..."), or the text."""
    found = re.search(r"\[(?:SSL|X509)[^]]*\] (.*?)\.? \(_ssl\.c:\d+\)", text)
    return found.group(1) if found else text


def check_tls_files(
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    prefix: str,
    error: type[Exception],
) -> None:
    """Loads the TLS files as a connection will (their flags are ``--<prefix>_ca_file``,
    ``--<prefix>_cert_file`` and ``--<prefix>_key_file``).

    Raises:
        error: One of them is missing or malformed, named by its flag.
    """
    context = ssl.create_default_context()
    try:
        if ca_file:
            context.load_verify_locations(ca_file)
    except OSError as problem:
        raise error(
            f"cannot use --{prefix}_ca_file {ca_file} ({_file_problem(problem)}): pass the "
            "CA certificate (PEM) that signed the server's"
        ) from None
    try:
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except OSError as problem:
        raise error(
            f"cannot use --{prefix}_cert_file {cert_file} with --{prefix}_key_file "
            f"{key_file} ({_file_problem(problem)}): pass a client certificate (PEM) "
            "and its key"
        ) from None


def _file_problem(error: OSError) -> str:
    """What is wrong with a file the ssl module could not load (SSLError is an OSError)."""
    return ssl_detail(str(error)) if isinstance(error, ssl.SSLError) else error.strerror
