"""A TLS-terminating proxy on loopback in front of a plain TCP server: the Redis and
Valkey servers the test extras install are built without TLS (``--tls-port`` is
refused), so a Redis speaking TLS is one of them behind this proxy."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading


class TlsProxy:
    """Accepts TLS on a free loopback port (`port`) and forwards the bytes to
    ``127.0.0.1:backend_port``, a thread per connection.

    Each handshake is OpenSSL's own on a blocking socket, so a client refused (no
    client certificate, one of another CA) gets the TLS alert a TLS server sends. Like
    a Redis that checks clients against a CA, the proxy sends that CA with its own
    certificate (OpenSSL builds the chain from the certificates it trusts).

    Args:
        backend_port: The plain TCP server's port.
        cert_path, key_path: The certificate the proxy presents and its key.
        client_ca_path: Require a client certificate signed by this CA (None: none asked).
    """

    def __init__(
        self,
        backend_port: int,
        cert_path: str,
        key_path: str,
        client_ca_path: str | None = None,
    ) -> None:
        self.backend_port = backend_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_path, key_path)
        if client_ca_path:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca_path)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting (the connections open end with their clients)."""
        with contextlib.suppress(OSError):  # wakes the accept blocked in its thread
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by `stop`
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        # A second handle on the connection, which outlives a failed handshake.
        linger = client.dup()
        try:
            secure = self.context.wrap_socket(client, server_side=True)
        except (OSError, ssl.SSLError):
            # Refused: the alert is sent. Closing at once would race the client's first
            # write, which could then fail before it reads the alert: wait for its close.
            with linger, contextlib.suppress(OSError):
                linger.settimeout(30)
                while linger.recv(65536):
                    pass
            return
        linger.close()
        with secure, socket.create_connection(("127.0.0.1", self.backend_port)) as backend:
            with contextlib.suppress(OSError, ssl.SSLError):
                _relay(secure, backend)


def _relay(secure: ssl.SSLSocket, backend: socket.socket) -> None:
    """Copies bytes both ways in one thread (an SSL socket must not be read and written
    by two threads at once) until either side closes."""
    while True:
        readable = [secure] if secure.pending() else select.select([secure, backend], [], [])[0]
        for sock, other in ((secure, backend), (backend, secure)):
            if sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                other.sendall(data)
