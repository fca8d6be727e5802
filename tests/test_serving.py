"""ncf-serve as a process, over real HTTP: TensorFlow Serving's REST API, a server
started before any export, servers killed and restarted beside a trainer killed and
restarted (they answer alike, and as the trainer's last version), damaged and missing
publications named and mended by the next version, and bad requests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
from conftest import truncate_half

from recommendation.data import constants
from recommendation.online import online_ncf
from recommendation.online.state import serving_export, versioned_export
from recommendation.serving import publications
from recommendation.serving.online_version import OnlineVersion

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER_FLAGS = [
    "--num_factors=4",
    "--layers=8,4",
    "--user_capacity=512",
    "--item_capacity=256",
    "--prequential_negatives=9",
    "--batch_size=64",
    "--sink_size=1",
    "--seed=1",
]


def _wait_for(condition, what: str, *processes: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        for process in processes:
            assert process.poll() is None, f"{process.args[2]} died before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


class _Server:
    """An ncf-serve process listening on a free port of 127.0.0.1, and requests to it."""

    def __init__(self, tmp_path, name: str, base, *flags: str) -> None:
        self.log = tmp_path / f"{name}.err"
        with open(self.log, "w") as stderr:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "recommendation.serve_main",
                    "--model_name=ncf",
                    f"--model_base_path={base}",
                    "--rest_api_host=127.0.0.1",
                    "--rest_api_port=0",
                    *flags,
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": ROOT},
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        port = _wait_for(
            lambda: re.search(r"on http://127.0.0.1:(\d+)/", self.text()), "its port", self.process
        )
        self.url = f"http://127.0.0.1:{port[1]}/v1/models/"

    def text(self) -> str:
        return open(self.log).read()

    def request(self, path: str, body: bytes | dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(
            self.url + path, data=data, method="GET" if data is None else "POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def status(self) -> dict | None:
        code, body = self.request("ncf")
        return json.loads(body)["publications"] if code == 200 else None

    def holds(self, run: str, seq: int) -> bool:
        status = self.status()
        return status is not None and (status["run"], status["publication"]) == (run, seq)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)
        self.process.wait(timeout=60)


def _append(path, events: np.ndarray) -> None:
    with open(path, "a") as out:
        out.writelines(f"{user},{item},{stamp}\n" for user, item, stamp in events.tolist())


def _events(start: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(start)
    users = rng.integers(0, 300, count)
    return np.stack(
        [users, users % 40 + rng.integers(0, 20, count), np.arange(start, start + count)], 1
    )


def _trainer(tmp_path, name: str, events_dir, export) -> subprocess.Popen:
    with (
        open(tmp_path / f"{name}.out", "w") as stdout,
        open(tmp_path / f"{name}.err", "w") as stderr,
    ):
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "recommendation.online_main",
                *TRAINER_FLAGS,
                f"--events_dir={events_dir}",
                f"--model_dir={tmp_path / 'model'}",
                f"--export_dir={export}",
                "--publish_every_secs=0.1",
                "--export_every_secs=100000",
                "--checkpoint_every_steps=10",
                "--checkpoint_every_secs=100000",
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=stdout,
            stderr=stderr,
        )


def _trained_to(server: _Server, size: int) -> bool:
    position = (server.status() or {}).get("position") or {"offsets": {}}
    return position["offsets"].get("a.csv") == size


QUERIES = (
    {"signature_name": "recommend", "inputs": {"user_id": [*range(0, 300, 7), 10**12], "k": 10}},
    {"instances": [{"user_id": user, "item_id": user % 50} for user in range(0, 300, 11)]},
)


def test_servers_and_a_trainer_killed_and_restarted_answer_as_its_last_version(tmp_path):
    events_dir, export = tmp_path / "events", tmp_path / "export"
    events_dir.mkdir()
    events = events_dir / "a.csv"
    events.touch()
    first = _Server(tmp_path, "first", export)  # before the trainer: it waits, and says so
    _wait_for(lambda: "waiting for one" in first.text(), "the wait said", first.process)
    assert (
        f"no version in {export} yet: waiting for one (ncf-online --export_dir {export} "
        "writes them)" in first.text()
    )
    assert first.request("ncf") == (404, b'{"error": "Could not find any versions of model ncf"}')
    assert first.request("ncf:predict", QUERIES[0]) == (
        404,
        b'{"error": "Servable not found for request: Latest(ncf)"}',
    )
    trainer = _trainer(tmp_path, "trainer", events_dir, export)
    _append(events, _events(0, 900))  # 15 steps: a checkpoint at 10
    _wait_for(
        lambda: _trained_to(first, os.path.getsize(events)), "the first events served", trainer
    )
    never_stopped = _Server(tmp_path, "never_stopped", export)
    _append(events, _events(900, 600))
    first.stop(signal.SIGKILL)  # mid-stream
    _wait_for(
        lambda: _trained_to(never_stopped, os.path.getsize(events)), "the next events", trainer
    )
    served_step = never_stopped.status()["step"]
    checkpoint = tf.train.latest_checkpoint(str(tmp_path / "model"))
    assert int(checkpoint.rsplit("-", 1)[1]) < served_step  # the trainer publishes ahead of it
    trainer.kill()  # kill -9: a restart resumes from the older checkpoint, as a new run
    trainer.wait()
    restarted = _Server(tmp_path, "restarted", export)
    trainer = _trainer(tmp_path, "trainer2", events_dir, export)
    _append(events, _events(1500, 700))
    _wait_for(
        lambda: _trained_to(never_stopped, os.path.getsize(events)),
        "the events after the restart",
        trainer,
    )
    trainer.send_signal(signal.SIGTERM)  # its last publication and version, then it exits
    assert trainer.wait(timeout=120) == 0, open(tmp_path / "trainer2.err").read()[-3000:]
    newest = versioned_export.latest_export(str(export))
    info = versioned_export.read_info(newest)
    for server in (never_stopped, restarted):
        _wait_for(
            lambda server=server: server.holds(info["run"], info["publication"]),
            "the last publication",
            server.process,
        )
    # The trainer's restart, said once: from an older step, as a new run.
    [said] = [line for line in never_stopped.text().splitlines() if "new run" in line]
    assert re.search(
        r"the trainer started a new run: serving its version \d+ \(step \d+, .*\) where step "
        rf"{served_step} of the run before was served: it restarted from an earlier checkpoint$",
        said,
    ), said
    # The same answers from both servers, byte for byte, and the trainer's last version's.
    version = OnlineVersion(info["model"])
    tf.train.Checkpoint(root=version).read(
        os.path.join(newest, "variables", "variables")
    ).expect_partial()
    version.reindex()
    for query in QUERIES:
        answers = [server.request("ncf:predict", query) for server in (never_stopped, restarted)]
        assert answers[0][0] == 200 and answers[0] == answers[1], answers
        answer = json.loads(answers[0][1])
        if "inputs" in query:
            expected = version.recommend(
                tf.constant(query["inputs"]["user_id"], tf.int64), tf.constant(10)
            )
            assert answer["outputs"]["item_ids"] == expected["item_ids"].numpy().tolist()
            assert (
                answer["outputs"]["known"][-1] is False
                and answer["outputs"]["item_ids"][-1] == [-1] * 10
            )
        else:
            pairs = query["instances"]
            expected = version.serve(
                tf.constant([p["user_id"] for p in pairs], tf.int64),
                tf.constant([p["item_id"] for p in pairs], tf.int64),
            )
            assert [p["scores"] for p in answer["predictions"]] == expected[
                "scores"
            ].numpy().tolist()
    for server in (never_stopped, restarted):
        server.stop()
        assert server.process.returncode == 0


def _step(rec_model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = {
        constants.USER_COLUMN: rng.integers(0, 100, [1, 64]),
        constants.ITEM_COLUMN: rng.integers(0, 30, [1, 64]),
        constants.TIME_COLUMN: np.zeros([1, 64], np.int64),
    }
    rec_model.train(1, [batch], dataset_sink_mode=False)


def _publish(export: serving_export.ExportCallback, count: int, seed: int) -> None:
    for index in range(count):
        _step(export.rec_model, seed + index)
        step = int(export.rec_model.step.numpy())
        assert export.publisher.publish(step, {"step": step})
        assert export.publisher.wait(60)


def _answers(server: _Server) -> list:
    return [json.loads(server.request("ncf:predict", query)[1]) for query in QUERIES]


def _expected(network) -> list:
    """What a server holding `network`'s state answers `QUERIES`."""
    version = OnlineVersion(json.loads(json.dumps(network.get_config())))
    version.copy_from(network)
    version.reindex()
    users = tf.constant(QUERIES[0]["inputs"]["user_id"], tf.int64)
    top = {
        name: value.numpy().tolist()
        for name, value in version.recommend(users, tf.constant(10)).items()
    }
    pairs = QUERIES[1]["instances"]
    scores = version.serve(
        tf.constant([p["user_id"] for p in pairs], tf.int64),
        tf.constant([p["item_id"] for p in pairs], tf.int64),
    )
    return [top["item_ids"], scores["scores"].numpy().tolist()]


def _served(answers: list) -> list:
    return [answers[0]["outputs"]["item_ids"], [p["scores"] for p in answers[1]["predictions"]]]


def test_a_damaged_or_missing_publication_is_named_and_the_next_version_mends_it(tmp_path):
    base = tmp_path / "export"
    tf.keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(
        online_ncf.OnlineParams(mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0))
    )
    export = serving_export.ExportCallback(
        str(base), every_steps=10**9, keep=5, publish_every_seconds=10**9
    )
    export.set_rec_model(rec_model)
    export.on_train_begin()  # version 0: the run's start
    export.wait()
    run = export.run
    _publish(export, 2, seed=1)
    before = _expected(rec_model.network)  # the state of publication 2
    _publish(export, 1, seed=3)
    damaged = publications.path(str(base), run, 3)
    truncate_half(damaged)
    server = _Server(tmp_path, "server", base)
    _wait_for(
        lambda: "is truncated or damaged" in server.text(), "the damage named", server.process
    )
    [said] = [line for line in server.text().splitlines() if "truncated" in line]
    assert said.endswith(
        f"publication 3 of run {run}: {damaged} is truncated or damaged (File is not a zip file); "
        "serving step 2 until a version holds what it lacks"
    ), said
    assert server.holds(run, 2) and _served(_answers(server)) == before  # its last whole state
    assert export.act()  # a version of the trainer's model as it is: publication 3's state
    export.wait()
    _wait_for(lambda: server.holds(run, 3), "the version loaded", server.process)
    assert _served(_answers(server)) == _expected(rec_model.network)
    server.stop()

    # A publication gone while a later one is there, found by a server started then.
    _publish(export, 2, seed=5)
    os.remove(publications.path(str(base), run, 4))
    server = _Server(tmp_path, "again", base)
    _wait_for(lambda: "is missing" in server.text(), "the gap named", server.process)
    assert server.holds(run, 3)
    export.act()
    export.wait()
    _wait_for(lambda: server.holds(run, 5), "the version loaded", server.process)
    assert _served(_answers(server)) == _expected(rec_model.network)
    _bad_requests_get_4xx_with_the_reason(server)
    server.stop()
    export.on_train_end()


def _bad_requests_get_4xx_with_the_reason(server: _Server) -> None:
    version = server.status()["version"]
    cases = [
        (
            "ncf:predict",
            b"{not json",
            400,
            "JSON Parse error: Expecting property name enclosed in double quotes: line 1 column 2 "
            "(char 1)",
        ),
        (
            "ncf:predict",
            b"[1, 2]",
            400,
            'the request must be a JSON object with "instances" or "inputs"',
        ),
        (
            "ncf:predict",
            {"signature_name": "top", "inputs": {}},
            400,
            'Serving signature name: "top" not found in signature def; this model has '
            "serving_default and recommend",
        ),
        ("other:predict", QUERIES[0], 404, "Servable not found for request: Latest(other)"),
        (
            f"ncf/versions/{version + 1}:predict",
            QUERIES[0],
            404,
            f"Servable not found for request: Specific(ncf, {version + 1})",
        ),
        (
            "ncf:predict",
            {"signature_name": "recommend", "inputs": {"user_id": [1], "k": 0}},
            400,
            "k must be at least 1, got 0",
        ),
        (
            "ncf:predict",
            {"signature_name": "recommend", "inputs": {"user_id": [1]}},
            400,
            '"inputs" lacks k: the inputs are user_id, k',
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": "7", "item_id": 1}]},
            400,
            'input "user_id" holds "7", not an integer',
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": 1.5, "item_id": 1}]},
            400,
            'input "user_id" holds 1.5, not an integer',
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": 2**63, "item_id": 1}]},
            400,
            'input "user_id" holds 9223372036854775808, outside int64',
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": 1}]},
            400,
            "instance 0 lacks item_id: the inputs are user_id, item_id",
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": 1, "item_id": 2}], "inputs": {}},
            400,
            'give exactly one of "instances" (rows) and "inputs" (columns)',
        ),
        (
            "ncf:predict",
            {"instances": [{"user_id": 1, "item_id": 1}] * 1025},
            400,
            "1,025 instances in one request: at most 1,024 (--max_instances)",
        ),
        ("other", None, 404, "Could not find any versions of model other"),
    ]
    for path, body, status, message in cases:
        assert server.request(path, body) == (status, json.dumps({"error": message}).encode()), path
    code, body = server.request(
        "ncf:predict",
        {
            "signature_name": "recommend",
            "instances": [{"user_id": 1, "k": 2}, {"user_id": 2, "k": 10**6}],
        },
    )
    answer = json.loads(body)["predictions"]
    assert code == 200 and len(answer[0]["item_ids"]) == len(
        answer[1]["item_ids"]
    )  # k cut to the items
    assert answer[0]["item_ids"][2:] == [-1] * (len(answer[0]["item_ids"]) - 2)


def test_the_server_listens_on_a_tcp_socket_and_names_a_taken_port():
    """Its connections get TCP_NODELAY from asyncio only if its socket says TCP (else a
    kept-alive connection waits 40 ms for each answer after its first); a taken port is
    an error that says what to do."""
    from recommendation import serve_main

    sock = serve_main.listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        port = sock.getsockname()[1]
        with pytest.raises(serve_main.ServeError) as raised:
            serve_main.listen("127.0.0.1", port)
        assert str(raised.value) == (
            f"cannot listen on 127.0.0.1:{port}: Address already in use; stop what listens "
            "there or pass --rest_api_port (0: any free port) or --rest_api_host"
        )
    finally:
        sock.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--publication_channel=pubs"],
            "--publication_channel is a topic or stream: give its broker, --kafka_servers or "
            "--redis_url (one of them)",
        ),
        (["--rest_api_port=-1"], "--rest_api_port must not be negative"),
        (["--max_instances=0"], "--max_instances must be a positive number"),
    ],
)
def test_bad_server_flags_are_refused_with_the_reason(args, message):
    from absl import flags as absl_flags

    from recommendation import serve_main

    flag_values = absl_flags.FlagValues()
    serve_main.define_serve_flags(flag_values)
    with pytest.raises(absl_flags.IllegalFlagValueError, match=re.escape(message)):
        flag_values(["ncf-serve", "--model_base_path=/e", *args])


def test_the_default_server_flags_are_tensorflow_servings_and_the_configs():
    from absl import flags as absl_flags

    from recommendation import serve_main

    flag_values = absl_flags.FlagValues()
    serve_main.define_serve_flags(flag_values)
    flag_values(["ncf-serve", "--model_base_path=/e"])
    config = serve_main.config_from_flags(flag_values)
    assert config == serve_main.ServeConfig(model_base_path="/e")
    assert (config.model_name, config.rest_api_port) == ("default", 8501)
    assert config.file_system_poll_wait_seconds == 1.0
