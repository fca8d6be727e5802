"""RecModel: loss modes, sinks and callbacks, signals, checkpoints, amp and boost."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import logging

from official.utils.misc import machine
from recommendation.online import callbacks as online_callbacks
from recommendation.online.callback_base import Callback
from recommendation.online.rec_model import RecModel
from recommendation.online.sources import stream_batches
from recommendation.online.sources.stream_batches import StreamBatch

WEIGHTS = np.array([[1.0], [-2.0], [0.5], [1.5]], np.float32)


def _network() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


def _batches(count: int, size: int = 32, seed: int = 0):
    """Linearly separable (x, y) batches, each a StreamBatch with its ordinal."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        x = rng.normal(size=(size, 4)).astype(np.float32)
        yield StreamBatch((x, (x @ WEIGHTS > 0).astype(np.float32)), index, size, [index])


def _loss():
    return keras.losses.BinaryCrossentropy(from_logits=True)


class _Recorder(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps, self.idle, self.ended = [], 0, False

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.steps.append(batch)

    def on_idle(self, logs=None) -> None:
        self.idle += 1

    def on_train_end(self, logs=None) -> None:
        self.ended = True


@pytest.mark.parametrize(
    "sink_mode, sink_size, expected",
    [(True, 3, [3, 6, 9, 10]), (True, 1, list(range(1, 11))), (False, 3, list(range(1, 11)))],
)
def test_step_end_callbacks_run_once_per_sink(sink_mode, sink_size, expected):
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    recorder = _Recorder()
    summary = model.online_train(_batches(10), [recorder], sink_mode, sink_size)
    assert recorder.steps == expected
    assert summary["steps"] == 10 and summary["events"] == 320
    assert summary["stopped_by"] == "end of data" and recorder.ended
    assert model.position == 9 and model.trained_ids == [9]


class _SinkWatcher(Callback):
    """Notes, for each sink, which thread read it and what its begin found there."""

    def __init__(self) -> None:
        super().__init__()
        self.read, self.began = [], []

    def on_sink_read(self, group) -> None:
        group.notes[self] = (group.ids, threading.current_thread().name)
        self.read.append(group.ids)

    def on_sink_begin(self, group) -> None:
        self.began.append(group.notes[self])


@pytest.mark.parametrize(
    "boost_level, reader", [("O0", "MainThread"), ("O1", "rec-model-prefetch")]
)
def test_each_sink_is_seen_as_read_on_the_reading_thread_then_before_it_trains(boost_level, reader):
    """What follows from the stream alone (the prequential plans) is prepared as each
    sink is read, in stream order, on the thread that reads ahead (O1): off the
    training thread; each sink's begin finds its own notes."""
    watcher = _SinkWatcher()
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01), boost_level=boost_level)
    model.online_train(_batches(7), [watcher], sink_size=2)
    sinks = [[0, 1], [2, 3], [4, 5], [6]]
    assert watcher.read == sinks
    assert watcher.began == [(ids, reader) for ids in sinks]


class _KernelProbe(Callback):
    """Probes the first layer's kernel before each step, times the step's number in the
    stream (read with its sink)."""

    def __init__(self) -> None:
        super().__init__()
        self.before, self.probed, self.steps = [], [], 0

    def on_sink_read(self, group) -> None:
        numbers = np.arange(self.steps, self.steps + group.num_steps) + 1
        group.probe_inputs[self] = numbers.astype(np.float32)
        self.steps += group.num_steps

    def probe(self, numbers, step):
        return self.rec_model.network.layers[0].kernel[None] * numbers[step]

    def on_sink_begin(self, group) -> None:
        self.before.append(self.rec_model.network.layers[0].kernel.numpy())

    def on_sink_end(self, group) -> None:
        self.probed.extend(group.probe_outputs[self])


@pytest.mark.parametrize("boost_level", ["O0", "O1", "O2"])
def test_a_probe_reads_the_model_as_it_was_before_its_step_trains(boost_level):
    """Test, then train, step by step: a callback's probe of each step runs in its
    sink's graph call on what it read with the sink, and sees the weights every earlier
    step left, whatever the sink's size: with 2 steps a sink, what one step a sink saw
    before each step, to the bit."""
    probes = {}
    for sink_size in (1, 2):
        probes[sink_size] = _KernelProbe()
        model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.1), boost_level=boost_level)
        model.online_train(_batches(5), [probes[sink_size]], sink_size=sink_size)
    before = probes[1].before  # a sink a step: before each step
    assert len(before) == 5 and len(probes[2].probed) == 5
    for number, (kernel, probed) in enumerate(zip(before, probes[2].probed, strict=True), 1):
        np.testing.assert_array_equal(probed, kernel * np.float32(number))
    assert not np.array_equal(before[1], before[0])  # it trained


def test_what_lives_through_online_training_is_kept_out_of_the_collectors_passes():
    """The objects alive when training starts and those the trace of the step makes
    (TensorFlow, the model, the graph) are frozen while it runs, so that the lists a
    stream read allocates by the thousand no longer make every full collection walk
    them, and are handed back to the collector when it returns."""
    counts = {}

    def batches():
        counts["first read"] = gc.get_freeze_count()
        yield from _batches(3)

    class AfterTheTrace(Callback):
        def on_train_batch_end(self, batch, logs=None) -> None:
            counts.setdefault("first step end", gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    model.online_train(batches(), [AfterTheTrace()], sink_size=1)
    assert 0 < counts["first read"] < counts["first step end"]
    assert gc.get_freeze_count() == 0


def test_train_runs_epochs_over_a_finite_dataset():
    class Epochs(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.ended = []

        def on_epoch_end(self, epoch, logs=None) -> None:
            self.ended.append((epoch, logs["step"]))

    data = [b.data for b in _batches(5)]
    epochs = Epochs()
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    summary = model.train(3, data, [epochs])  # sink_size -1: a whole epoch per sink
    assert epochs.ended == [(0, 5), (1, 10), (2, 15)] and summary["steps"] == 15


def test_loss_falls_and_eval_reports_named_metrics():
    model = RecModel(
        _network(), _loss(), keras.optimizers.Adam(0.05), metrics={"loss", "auc", "precision"}
    )
    before = model.eval([b.data for b in _batches(4, seed=1)])
    model.online_train(_batches(150), sink_size=10)
    after = model.eval([b.data for b in _batches(4, seed=1)])
    assert after["loss"] < before["loss"] / 2
    assert after["auc"] > 0.95 and after["precision"] > 0.8


def test_eval_network_outputs_are_picked_by_eval_indexes():
    network = _network()

    class EvalNetwork(keras.Model):
        def call(self, x, y):
            logits = network(x)
            return logits, _loss()(y, logits), y  # prediction, loss, label

    model = RecModel(
        network,
        _loss(),
        keras.optimizers.Adam(0.05),
        metrics=["loss", keras.metrics.AUC(from_logits=True, name="auc_logits")],
        eval_network=EvalNetwork(),
        eval_indexes=[1, 0, 2],
    )
    model.online_train(_batches(100), sink_size=10)
    results = model.eval([b.data for b in _batches(4, seed=1)])
    assert set(results) == {"loss", "auc_logits"} and results["auc_logits"] > 0.95


def test_a_network_computing_its_own_loss_logs_its_other_outputs():
    class WithLoss(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.body = _network()

        def call(self, x, y, training=None):
            logits = self.body(x, training=training)
            return {"loss": _loss()(y, logits), "positives": tf.reduce_mean(y)}

    network = WithLoss()
    network(np.zeros((1, 4), np.float32), np.zeros((1, 1), np.float32))
    summary = RecModel(network, optimizer=keras.optimizers.Adam(0.01)).online_train(_batches(5))
    assert set(summary["logs"]) >= {"loss", "positives", "events", "step"}
    assert 0.0 < summary["logs"]["positives"] < 1.0


def test_without_an_optimizer_a_compiled_network_updates_itself():
    network = _network()
    network.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    before = [w.numpy().copy() for w in network.trainable_weights]
    model = RecModel(network)
    summary = model.online_train(_batches(6), sink_size=2)
    assert summary["steps"] == 6 and int(network.optimizer.iterations.numpy()) == 6
    after = [w.numpy() for w in network.trainable_weights]
    assert any(not np.allclose(a, b) for a, b in zip(before, after, strict=True))


def test_tf_data_and_plain_iterables_are_accepted():
    data = [b.data for b in _batches(4)]
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.stack([x for x, _ in data]), np.stack([y for _, y in data]))
    )
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    assert model.online_train(dataset, sink_size=3)["events"] == 128
    assert model.online_train(iter(data), dataset_sink_mode=False)["steps"] == 8


def test_a_tf_data_dataset_is_read_without_autotuning():
    # Its model thread would hold the iterator's deletion, at the end of each pass,
    # until its next optimisation (runner.without_autotuning).
    data = [b.data for b in _batches(2)]
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.stack([x for x, _ in data]), np.stack([y for _, y in data]))
    )
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    model.online_train(dataset)
    assert model._dataset.options().autotune.enabled is False


def test_a_partial_batch_ends_a_sink_and_trains_on_its_own():
    batches = [b.data for b in _batches(3)]
    x, y = batches[1]
    batches[1] = (x[:5], y[:5])
    recorder = _Recorder()
    RecModel(_network(), _loss(), keras.optimizers.Adam(0.01)).online_train(
        iter(batches), [recorder], sink_size=3
    )
    assert recorder.steps == [1, 2, 3]


def test_quiet_streams_call_on_idle_and_stop_after_can_end_them():
    quiet_reads = [0]

    def stream():
        yield from _batches(2)
        while True:
            quiet_reads[0] += 1
            yield None  # a source with nothing new

    recorder = _Recorder()
    stop = online_callbacks.StopAfter(idle_seconds=0.2)
    summary = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01)).online_train(
        stream(), [recorder, stop]
    )
    assert summary["stopped_by"] == "callback" and summary["steps"] == 2
    # How many quiet reads fit in 0.2 s is timing; each one (O0 reads none ahead) is
    # one on_idle call.
    assert recorder.idle == quiet_reads[0] >= 1


def test_online_train_returns_only_once_the_read_ahead_thread_has_ended():
    """A read-ahead thread still inside a read (TensorFlow polling gs://, a socket)
    when the interpreter exits is killed there and aborts the process (CI saw
    online_main exit -6 after a successful run): the thread must be gone first."""
    reading = threading.Event()

    def stream():
        yield from _batches(2)
        while True:
            reading.set()
            time.sleep(0.5)  # a slow read of a quiet source
            reading.clear()
            yield None

    summary = RecModel(
        _network(), _loss(), keras.optimizers.Adam(0.01), boost_level="O1"
    ).online_train(stream(), [online_callbacks.StopAfter(steps=2)])
    assert summary["steps"] == 2
    assert not reading.is_set()
    assert "rec-model-prefetch" not in [thread.name for thread in threading.enumerate()]


def test_closing_the_read_ahead_ends_its_thread_when_the_source_ended_unread():
    prefetcher = stream_batches.Prefetcher(iter(range(5)), depth=2)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


@pytest.mark.integration
def test_sigterm_finishes_the_step_checkpoints_and_commits(tmp_path):
    class Stream:
        def __init__(self, count: int) -> None:
            self.count, self.commits, self.restored = count, [], None

        def __iter__(self):
            for batch in _batches(self.count):
                if batch.position == 7:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives during this step
                yield batch

        def restore(self, position):
            self.restored = position

        def commit(self, position):
            self.commits.append(position)

    checkpoints = str(tmp_path / "ckpt")
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    stream = Stream(50)
    summary = model.online_train(
        stream, [online_callbacks.CheckpointCallback(checkpoints, every_steps=100)]
    )
    assert summary["stopped_by"] == f"signal {int(signal.SIGTERM)}"
    assert summary["steps"] == 8 and stream.commits == [7]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    # A new process restores step, weights and the position it hands to the stream.
    restored = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    stream = Stream(0)
    restored.online_train(stream, [online_callbacks.CheckpointCallback(checkpoints, 100)])
    assert int(restored.step.numpy()) == 8 and stream.restored == 7
    for a, b in zip(model.network.weights, restored.network.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_periodic_checkpoints_follow_the_schedule(tmp_path):
    model = RecModel(_network(), _loss(), keras.optimizers.Adam(0.01))
    callback = online_callbacks.CheckpointCallback(str(tmp_path), every_steps=4, keep=10)
    model.online_train(_batches(10), [callback], sink_size=2)
    numbers = sorted(int(p.rsplit("-", 1)[1]) for p in callback.manager.checkpoints)
    assert numbers == [4, 8, 10]


@pytest.mark.parametrize("boost_level", ["O1", "O2"])
def test_boost_levels_train_the_same_function(boost_level):
    results = {}
    for level in ("O0", boost_level):
        model = RecModel(_network(), _loss(), keras.optimizers.SGD(0.1), boost_level=level)
        model.online_train(_batches(6), sink_size=3)
        results[level] = [w.numpy() for w in model.network.weights]
    for a, b in zip(results["O0"], results[boost_level], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "amp_level, isa, warned",
    [
        ("O2", "sse4_2 avx avx2 fma", True),
        ("O3", "sse4_2 avx avx2 fma", True),
        ("O0", "sse4_2 avx avx2 fma", False),
        ("O2", "avx2 fma avx512f avx512_bf16", False),
    ],
)
def test_bf16_amp_on_a_cpu_without_bf16_instructions_says_to_use_fp32(
    monkeypatch, amp_level, isa, warned
):
    monkeypatch.setattr(machine, "describe_cpu", lambda: machine.CpuInfo("a CPU", isa))
    said = []
    monkeypatch.setattr(logging, "warning", lambda text, *args: said.append(text % args))
    RecModel(_network(), _loss(), keras.optimizers.Adam(0.05), amp_level=amp_level)
    expected = [line for line in said if line.startswith(f"amp_level {amp_level} computes in bf16")]
    assert len(expected) == int(warned) and len(said) == int(warned)


@pytest.mark.parametrize("amp_level", ["O2", "O3"])
def test_amp_levels_compute_in_bfloat16_on_cpu_and_keep_float32_variables(amp_level):
    network = _network()
    model = RecModel(network, _loss(), keras.optimizers.Adam(0.05), amp_level=amp_level)
    assert network.layers[0].compute_dtype == "bfloat16"
    assert network.layers[-1].compute_dtype == ("float32" if amp_level == "O2" else "bfloat16")
    assert all(w.dtype == "float32" for w in network.weights)
    summary = model.online_train(_batches(60), sink_size=10)
    assert np.isfinite(summary["logs"]["loss"]) and summary["logs"]["loss"] < 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"amp_level": "O1"}, "amp_level"),
        ({"boost_level": "O3"}, "boost_level"),
        ({"eval_network": keras.layers.Dense(1)}, "eval_indexes"),
        ({"metrics": ["f1"]}, "unknown metric"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecModel(_network(), _loss(), **kwargs)


def test_sink_size_must_be_positive():
    with pytest.raises(ValueError, match="sink_size"):
        RecModel(_network(), _loss(), keras.optimizers.Adam()).online_train([], sink_size=0)
