"""The producer process and the trainer's side: files, ready files, faults, cleanup."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT

from official.core import signals
from official.utils.logs import mlperf_helper
from recommendation.data import constants, data_preprocessing, preprocessing_cache, synthetic_data
from recommendation.producer import data_pipeline, run_folder
from recommendation.producer.data_async_generation import Producer
from recommendation.producer.data_pipeline import ProducerError, ProducerHandle
from recommendation.producer.run_folder import GenerationParams

SPEC = synthetic_data.SyntheticSpec(num_users=200, num_items=150, num_ratings=8000)


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    config = data_preprocessing.DataConfig(
        dataset="synthetic", data_dir=str(folder), synthetic=SPEC, seed=3
    )
    return preprocessing_cache.load_or_build(config).cache_path


@pytest.fixture(autouse=True)
def hang_guard():
    """Fails a test that would otherwise hang (the property under test is 'no hang')."""

    def on_alarm(signum, frame):
        raise TimeoutError("test hung")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _params(cache_path, **overrides) -> GenerationParams:
    values = dict(
        cache_path=cache_path,
        batch_size=1024,
        eval_users_per_batch=48,
        num_neg=4,
        num_eval_negatives=99,
        epochs_per_cycle=(1, 2),
        seed=7,
        num_shards=3,
    )
    values.update(overrides)
    return GenerationParams(**values)


def _points_read(dataset) -> tuple[int, int, int]:
    batches = positives = valid = 0
    for features, labels in dataset:
        mask = features[constants.VALID_POINT_MASK].numpy()
        batches += 1
        valid += int(mask.sum())
        positives += int(labels.numpy()[mask].sum())
        assert labels.numpy()[~mask].sum() == 0
    return batches, positives, valid


@pytest.mark.integration
def test_cycles_and_eval_through_a_producer_process(cache_path, tmp_path):
    num_train = preprocessing_cache.read_cache(cache_path).num_train_positives
    with ProducerHandle(_params(cache_path), str(tmp_path)) as producer:
        eval_info = producer.eval_data()
        assert (eval_info.num_users, eval_info.block_size) == (200, 100)
        blocks = list(data_pipeline.eval_input_fn(eval_info))
        assert len(blocks) == 5  # ceil(200 / 48)
        last = blocks[-1]
        assert last[constants.ITEM_COLUMN].shape == (48 * 100,)
        assert int(tf.reduce_sum(tf.cast(last[constants.VALID_POINT_MASK], tf.int32))) == (
            (200 - 4 * 48) * 100
        )
        for cycle, epochs in enumerate((1, 2)):
            info = producer.cycle(cycle)
            assert info.batches_per_epoch == -(-num_train * 5 // 1024)
            batches, positives, valid = _points_read(data_pipeline.train_input_fn(info))
            assert (batches, positives, valid) == (
                info.num_batches,
                epochs * num_train,
                epochs * num_train * 5,
            )
            producer.release(cycle)
        run_dir = producer.run_dir
        assert os.path.exists(os.path.join(run_dir, run_folder.PRODUCER_LOG))
    assert not os.path.exists(run_dir)
    assert os.listdir(tmp_path) == []


def _all_bytes(producer: ProducerHandle, num_cycles: int) -> dict[str, bytes]:
    contents = {}
    folders = [producer.eval_data().folder]
    for cycle in range(num_cycles):
        folders.append(producer.cycle(cycle).folder)
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.tfrecord"))):
            with open(path, "rb") as shard:
                contents[os.path.relpath(path, producer.run_dir)] = shard.read()
    return contents


def test_same_seed_gives_identical_bytes_whatever_the_worker_count(cache_path, tmp_path):
    runs = []
    for workers in (1, 3):
        params = _params(cache_path, num_workers=workers, cycles_to_buffer=2)
        with ProducerHandle(params, str(tmp_path), use_subprocess=False) as producer:
            runs.append(_all_bytes(producer, 2))
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == 9
    assert runs[0] == runs[1]
    with ProducerHandle(_params(cache_path, seed=8), str(tmp_path), use_subprocess=False) as other:
        assert _all_bytes(other, 2) != runs[0]


class _PublishWatch:
    """Opens shard writers that, when a folder's last shard closes, note what a reader
    would see then: whether the folder's ready file exists yet, and how many records its
    shards hold. The producer waits for each close to return before it does anything
    else, so the note is taken after the last close and before the ready file's rename
    in every run, whatever the timing (a polling watcher missed a ready file written
    too early)."""

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.closed: dict[str, int] = {}
        self.at_last_close: dict[str, tuple[bool, int]] = {}

    def open(self, path: str) -> _WatchedWriter:
        return _WatchedWriter(path, self)

    def on_close(self, path: str) -> None:
        folder = os.path.basename(os.path.dirname(path))
        self.closed[folder] = self.closed.get(folder, 0) + 1
        if self.closed[folder] == self.num_shards:
            shards = sorted(glob.glob(os.path.join(os.path.dirname(path), "*.tfrecord")))
            records = sum(1 for _ in tf.data.TFRecordDataset(shards))
            ready = os.path.exists(run_folder.ready_file(os.path.dirname(path)))
            self.at_last_close[folder] = (ready, records)


class _WatchedWriter:
    """A `tf.io.TFRecordWriter` that tells its watch when it has closed."""

    def __init__(self, path: str, watch: _PublishWatch) -> None:
        self._writer = tf.io.TFRecordWriter(path)
        self._path, self._watch = path, watch

    def write(self, record: bytes) -> None:
        self._writer.write(record)

    def close(self) -> None:
        self._writer.close()
        self._watch.on_close(self._path)


def test_a_ready_file_is_written_only_after_every_shard_is_closed(cache_path, tmp_path):
    """Eval folder and every cycle: no ready file while a shard is open; then one,
    over complete shards."""
    params = _params(cache_path, epochs_per_cycle=(1, 2), cycles_to_buffer=2, batch_size=256)
    num_train = preprocessing_cache.read_cache(cache_path).num_train_positives
    batches_per_epoch = -(-num_train * 5 // 256)
    expected = {
        run_folder.EVAL_FOLDERS[constants.TEST_SPLIT]: -(-200 // 48),
        "cycle_00000": batches_per_epoch,
        "cycle_00001": 2 * batches_per_epoch,
    }
    watch = _PublishWatch(params.num_shards)
    mlperf = mlperf_helper.MlperfLogger(None)
    Producer(str(tmp_path), params, lambda: False, mlperf, open_writer=watch.open).run()
    assert watch.closed == dict.fromkeys(expected, params.num_shards)
    # At the last close (after it, before the rename): complete shards, no ready file.
    assert watch.at_last_close == {folder: (False, count) for folder, count in expected.items()}
    for folder in expected:
        assert os.path.exists(tmp_path / folder / run_folder.READY_FILE)


@pytest.mark.integration
def test_killed_producer_raises_instead_of_hanging(cache_path, tmp_path):
    params = _params(cache_path, epochs_per_cycle=(1,) * 50, cycles_to_buffer=1)
    with ProducerHandle(params, str(tmp_path), stall_timeout_sec=60) as producer:
        producer.eval_data()
        os.kill(producer._process.pid, signal.SIGKILL)
        with pytest.raises(
            ProducerError,
            match=r"exited with status -9 while the trainer "
            r"waited for training cycle \d+; its log is .*"
            r"producer\.log",
        ):
            for cycle in range(50):
                producer.cycle(cycle)
                producer.release(cycle)


@pytest.mark.integration
def test_stalled_producer_raises_after_the_stall_timeout(cache_path, tmp_path):
    params = _params(cache_path, epochs_per_cycle=(1,) * 50, cycles_to_buffer=1)
    with ProducerHandle(params, str(tmp_path), stall_timeout_sec=2) as producer:
        producer.eval_data()
        os.kill(producer._process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ProducerError, match="made no progress for 2 s"):
                for cycle in range(50):
                    producer.cycle(cycle)
                    producer.release(cycle)
        finally:
            os.kill(producer._process.pid, signal.SIGCONT)


@pytest.mark.integration
def test_crashing_producer_reports_status_and_log(tmp_path):
    params = _params(str(tmp_path / "missing_cache.npz"))
    with ProducerHandle(params, str(tmp_path)) as producer:
        with pytest.raises(ProducerError, match=r"failed while the trainer waited .*missing_cache"):
            producer.eval_data()


_TRAINER = textwrap.dedent("""
    import sys
    from official.utils.misc import errors
    from official.core import signals
    from recommendation.producer.data_pipeline import ProducerHandle
    from recommendation.producer.run_folder import GenerationParams
    params = GenerationParams(cache_path=sys.argv[1], batch_size=512, eval_users_per_batch=10,
                              num_neg=4, num_eval_negatives=9, epochs_per_cycle=(1,) * 9,
                              seed=1)
    # As an entry point runs it: signals end the wait for a cycle that never comes
    # (the first two are never released, so the producer has no room for a third).
    with signals.stop_on_signals(), errors.exit_on_user_errors():
        with ProducerHandle(params, sys.argv[2]) as producer:
            producer.eval_data()
            print(producer._process.pid, flush=True)
            producer.cycle(2)
""")


@pytest.mark.integration
@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_trainer_signals_leave_no_producer_and_no_files(cache_path, tmp_path, signal_number):
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, cache_path, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    producer_pid = int(trainer.stdout.readline())
    trainer.send_signal(signal_number)
    trainer.wait(timeout=60)
    if signal_number != signal.SIGKILL:
        stopped = signal.Signals(signal_number).name
        assert trainer.returncode == 128 + signal_number
        assert trainer.stderr.read().splitlines()[-1] == f"stopped by {stopped}: nothing was kept"
    for _ in range(600):  # after kill -9 the producer notices its parent is gone
        if not _alive(producer_pid) and not os.listdir(tmp_path):
            break
        time.sleep(0.1)
    assert not _alive(producer_pid)
    assert os.listdir(tmp_path) == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_two_runs_on_one_folder_use_separate_run_dirs(cache_path, tmp_path):
    with (
        ProducerHandle(_params(cache_path), str(tmp_path), use_subprocess=False) as first,
        ProducerHandle(_params(cache_path), str(tmp_path), use_subprocess=False) as second,
    ):
        assert first.run_dir != second.run_dir
        assert first.cycle(0).folder != second.cycle(0).folder


def test_file_pipelines_run_without_autotuning(tmp_path):
    # An autotuned iterator's model thread held each cycle's iterator deletion for up
    # to a minute; a fixed-parallelism pipeline has no such thread.
    info = run_folder.CycleInfo(0, str(tmp_path), 1, 1, 8, 2)
    assert data_pipeline.train_input_fn(info).options().autotune.enabled is False
    eval_info = run_folder.EvalInfo(str(tmp_path), 1, 1, 3, 2, 2)
    assert data_pipeline.eval_input_fn(eval_info).options().autotune.enabled is False


def test_synthetic_batches_need_no_files():
    dataset = data_pipeline.synthetic_train_input_fn(batch_size=64, num_users=10, num_items=20)
    features, labels = next(iter(dataset))
    assert features[constants.USER_COLUMN].shape == (64,)
    assert int(tf.reduce_max(features[constants.ITEM_COLUMN])) < 20
    assert set(np.unique(labels.numpy())) <= {0.0, 1.0}


def test_an_unwritable_run_folder_is_one_clear_error(cache_path, tmp_path):
    # A read-only data dir whose valid cache is only read: the run folder is the
    # first thing ncf-main writes there, and --cache_dir is the fix.
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the folder would be")
    with pytest.raises(
        ProducerError,
        match=r"cannot write the producer's run folder in .*cache/runs: .*; pass --cache_dir "
        "with a writable folder",
    ):
        ProducerHandle(_params(cache_path), str(blocked / "runs")).launch()


@pytest.mark.integration
def test_a_start_interrupted_before_the_producer_is_up_leaves_nothing(cache_path, tmp_path):
    producer = ProducerHandle(_params(cache_path), str(tmp_path))
    with signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # pending: raised while hand_over waits
        with pytest.raises(signals.Interrupted), producer:
            producer.hand_over()
            pytest.fail("the producer started although a stop was pending")
    assert producer._process.poll() is not None  # started, then stopped
    assert os.listdir(tmp_path) == []


@pytest.mark.integration
def test_a_producer_whose_trainer_is_already_gone_cleans_up_and_exits(tmp_path):
    # The trainer can die (kill -9) before the producer it started has even looked at
    # its parent; the producer must not take whoever adopted it for its trainer.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no process's parent any more
    producer = subprocess.run(
        [
            sys.executable,
            "-m",
            "recommendation.producer.data_async_generation",
            f"--run_dir={run_dir}",
            f"--trainer_pid={gone.pid}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert producer.returncode == 0, producer.stderr[-2000:]
    assert not run_dir.exists()
