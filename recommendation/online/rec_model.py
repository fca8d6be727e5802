"""RecModel: MindSpore Rec's training front end (`train`, `eval`, `online_train`) on TF2.

The semantics are MindSpore's, translated:

- ``RecModel(network, loss_fn, optimizer, ...)``: with `loss_fn` the dataset yields
  ``(data, label)`` and the loss is ``loss_fn(label, network(data))``; without it the
  network computes its own loss from the dataset's elements (a tuple is passed as
  positional arguments) and returns it, alone, first in a tuple, or as ``"loss"`` of
  a dict whose other scalars are logged. ``optimizer=None`` means the network updates
  itself: a compiled Keras model runs its own ``train_step``, any other network is
  called with ``training=True`` and is expected to apply its updates.
- ``metrics``: names (``accuracy``, ``auc``, ``precision``, ``recall``, ``loss``,
  ``hit_rate``, ``ndcg``) or Keras metric objects, as a set, list or dict; `eval`
  reports them. Name-built classification metrics expect probabilities.
- ``eval_network`` with ``eval_indexes = [loss, prediction, label]``: positions of
  those in the evaluation network's outputs.
- ``amp_level``: ``O0`` float32; ``O2`` mixed precision (float32 variables and output
  layer, low-precision compute; float16 with dynamic loss scaling on GPU, bfloat16 on
  CPU); ``O3`` every layer in low precision, no loss scaling; ``auto``: O2 on GPU,
  O0 on CPU (as MindSpore picks per device).
- ``boost_level``: ``O0`` one graph call per step (or per sink); ``O1`` adds a
  background thread that reads and batches the next sink while the current one
  trains; ``O2`` adds XLA compilation of the step (of the part after
  ``network.resolve``, where the network has one: hash-table lookups cannot be
  compiled). Measured effects: docs/benchmarks.md.
- ``distribute(coordinator, max_in_flight)`` (an addition): the steps run on the workers of a
  parameter-server cluster, the network's resolve stage here (`cluster`).
- ``online_train(train_dataset, callbacks, dataset_sink_mode=True, sink_size=1)``
  runs until the dataset ends, a callback sets ``stop_training``, or SIGINT/SIGTERM
  arrives: then the step in flight finishes, ``on_train_end`` runs (the checkpoint
  callback saves and commits the stream offsets) and it returns. In sink mode each
  graph call runs `sink_size` steps (any positive number; MindSpore accepts 1) and
  step-end callbacks run once per sink; otherwise they run after every step. While it
  runs, the objects alive at its start and after each trace are frozen out of the
  garbage collector's full passes (``gc.freeze``; unfrozen when it returns).

Unbounded datasets may yield `StreamBatch` objects (`stream_batches`), which carry the
source offsets after the batch, and None while no data is available, so that
time-based callbacks (checkpoint, export) still run when the stream is quiet. A
dataset with ``restore(position)`` and ``commit(position)`` methods is told the
restored position before it is iterated and each position once a checkpoint holding
it is durable.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import keras
import tensorflow as tf

from official.core import precision, signals
from official.core.runner import traced, without_autotuning
from recommendation.online import cluster, sink_calls
from recommendation.online.callback_base import CallbackList
from recommendation.online.metrics import build_metrics
from recommendation.online.sources.stream_batches import (
    BatchGroup,
    Prefetcher,
    StreamBatch,
    group_batches,
)

AMP_LEVELS = ("O0", "O2", "O3", "auto")
BOOST_LEVELS = ("O0", "O1", "O2")


def _policy(amp_level: str) -> str | None:
    """The Keras policy of an amp level on this machine (None: float32 as it is)."""
    on_gpu = bool(tf.config.list_logical_devices("GPU"))
    if amp_level == "auto":
        amp_level = "O2" if on_gpu else "O0"
    mixed = precision.POLICIES["fp16" if on_gpu else "bf16"]
    return {"O0": None, "O2": mixed, "O3": mixed.removeprefix("mixed_")}[amp_level]


class RecModel(cluster.ClusterTraining):
    """Trains, evaluates and online-trains a Keras network (MindSpore Rec's RecModel).

    Its steps are traced as Keras 3 traces ``fit``'s, without AutoGraph: a network's
    control flow on tensors is written with ``tf.cond`` and ``tf.while_loop``.

    Args:
        network: A Keras model or layer.
        loss_fn: ``loss_fn(label, prediction) -> loss``; None: the network returns its
            loss.
        optimizer: A Keras optimiser; None: the network updates itself.
        metrics: Metric names or objects (set, list or dict) for `eval`.
        eval_network: Network used by `eval` instead of `network`.
        eval_indexes: ``[loss, prediction, label]`` positions in `eval_network`'s
            outputs.
        amp_level: ``O0``, ``O2``, ``O3`` or ``auto`` (module docstring).
        boost_level: ``O0``, ``O1`` or ``O2`` (module docstring).
    """

    def __init__(
        self,
        network: keras.layers.Layer,
        loss_fn: Callable | None = None,
        optimizer: keras.optimizers.Optimizer | None = None,
        metrics: dict | Iterable | None = None,
        eval_network: keras.layers.Layer | None = None,
        eval_indexes: list[int] | None = None,
        amp_level: str = "O0",
        boost_level: str = "O0",
    ) -> None:
        if amp_level not in AMP_LEVELS:
            raise ValueError(f"amp_level must be one of {AMP_LEVELS}, got {amp_level!r}")
        if boost_level not in BOOST_LEVELS:
            raise ValueError(f"boost_level must be one of {BOOST_LEVELS}, got {boost_level!r}")
        if eval_network is not None and (eval_indexes is None or len(eval_indexes) != 3):
            raise ValueError("eval_network needs eval_indexes = [loss, prediction, label]")
        self.network, self.loss_fn = network, loss_fn
        self.eval_network, self.eval_indexes = eval_network, eval_indexes
        self.metrics = build_metrics(metrics)
        self.boost_level = boost_level
        self.policy = _policy(amp_level)
        if self.policy is not None:
            self._apply_policy(amp_level)
            # `_policy` picks bf16 only on the CPU.
            precision.warn_if_bf16_is_slow_here(self.policy, f"amp_level {amp_level}")
        if optimizer is not None and self.policy is not None:
            optimizer = precision.with_loss_scaling(optimizer, self.policy)
        self.optimizer = optimizer
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.position: Any = None
        self.trained_ids: list = []  # source ids of the events of the last sink
        self.stop_training = False
        self._checkpoint: tf.train.Checkpoint | None = None
        self._position_variable: tf.Variable | None = None
        self._sink_calls = sink_calls.SinkCalls()
        self._eval_call: Callable | None = None
        self._dataset = None
        self.cluster: cluster.ClusterSteps | None = None

    def _apply_policy(self, amp_level: str) -> None:
        layers = self.network._flatten_layers(include_self=True, recursive=True)
        # O2 keeps the output layer (the last one created) in float32, Keras'
        # mixed-precision advice; O3 leaves nothing in float32.
        keep = {id(layers[-1])} if amp_level != "O3" and len(layers) > 1 else set()
        for layer in layers:
            if id(layer) not in keep:
                layer.dtype_policy = self.policy

    # -- checkpoints ---------------------------------------------------------

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        """The network, optimiser, step counter and stream position, as one object."""
        if self._checkpoint is None:
            self._checkpoint = self.new_checkpoint()
        return self._checkpoint

    def new_checkpoint(self) -> tf.train.Checkpoint:
        """A checkpoint object of the same state (`model_dir.restore_latest` restores
        through one of its own)."""
        self._build_optimizer()
        if self._position_variable is None:
            self._position_variable = tf.Variable("null", dtype=tf.string, trainable=False)
        return tf.train.Checkpoint(
            network=self.network,
            optimizer=self.optimizer,
            step=self.step,
            position=self._position_variable,
        )

    def before_save(self, trim: bool = True) -> None:
        """Copies the position of the last trained batch into the checkpoint, and
        trims the tables' rows to the live ones (for a full checkpoint: a delta holds
        the changed rows only, `delta_checkpoints`); on a cluster, first waits for
        the steps in flight, so that the checkpoint holds every step it counts."""
        self.finish_steps()
        self.checkpoint  # noqa: B018 (creates the position variable)
        if trim:
            self.trim_tables()
        self._position_variable.assign(json.dumps(self.position))

    def trim_tables(self) -> None:
        """Drops the rows the tables allocated beyond their live ones (before a
        checkpoint or an export), once the steps in flight are done."""
        self.finish_steps()
        for table in self.row_tables():
            table.trim()

    def after_restore(self) -> None:
        """Reads the restored position and hands it to the dataset."""
        self.position = json.loads(self._position_variable.numpy().decode())
        if self._dataset is not None and hasattr(self._dataset, "restore"):
            self._dataset.restore(self.position)

    def commit(self, position: Any = None) -> None:
        """Tells the dataset that everything up to `position` (None: the last trained
        batch's) is durably trained."""
        if self._dataset is not None and hasattr(self._dataset, "commit"):
            self._dataset.commit(self.position if position is None else position)

    def _build_optimizer(self) -> None:
        if self.optimizer is None or self.optimizer.built:
            return
        if not self.network.built:
            raise ValueError(
                "the network has no variables yet: build it (call it once) before "
                "checkpointing or training with an optimizer"
            )
        self.optimizer.build(self.network.trainable_variables)
        for table in self.row_tables():
            table.attach_optimizer(self.optimizer)

    def row_tables(self) -> list:
        """The layers that train their own rows (`HashEmbedding`: rows that grow and
        shrink are not Keras variables, so they sit outside the optimiser's list)."""
        layers = self.network._flatten_layers(include_self=True, recursive=True)
        return [layer for layer in layers if hasattr(layer, "train_rows")]

    # -- one step ------------------------------------------------------------

    def _forward(self, data, training: bool, compiled: Callable | None, resolved=False):
        """Network outputs for `data` (resolve stage outside any XLA cluster, unless
        `data` is `resolved` already)."""
        resolve = getattr(self.network, "resolve", None)
        if resolve is not None and not resolved:
            data = resolve(data, training=training)
        call = compiled or (lambda d: self._call(self.network, d, training))
        return call(data)

    @staticmethod
    def _call(network, data, training: bool):
        if isinstance(data, tuple):
            return network(*data, training=training)
        return network(data, training=training)

    def _loss_and_logs(self, data, compiled, resolved=False) -> tuple[tf.Tensor, dict]:
        if self.loss_fn is not None:
            features, label = data
            prediction = self._forward(features, True, compiled)
            loss = self.loss_fn(label, tf.cast(prediction, tf.float32))
            logs = {}
        else:
            outputs = self._forward(data, True, compiled, resolved)
            if isinstance(outputs, dict):
                logs = {k: tf.cast(v, tf.float32) for k, v in outputs.items() if k != "loss"}
                loss = outputs["loss"]
            elif isinstance(outputs, (tuple, list)):
                loss, logs = outputs[0], {}
            else:
                loss, logs = outputs, {}
        loss = tf.cast(loss, tf.float32)
        if self.network.losses:
            loss += tf.add_n([tf.cast(x, tf.float32) for x in self.network.losses])
        return loss, logs

    def _train_step(self, data, compiled, step: tf.Tensor | None = None) -> dict:
        """One step on `data`; with `step` (its number, from 1), a worker's step of a
        cluster: `data` is resolved, and the coordinator counts the steps and notes the
        rows changed."""
        if self.optimizer is None:
            if getattr(self.network, "compiled", False):
                logs = self.network.train_step(data)
            else:
                loss = self._call(self.network, data, True)
                logs = {"loss": loss[0] if isinstance(loss, (tuple, list)) else loss}
            self.step.assign_add(1)
            return {k: tf.cast(v, tf.float32) for k, v in logs.items() if not tf.nest.is_nested(v)}
        variables = self.network.trainable_variables
        tables = self.row_tables()
        with tf.GradientTape() as tape:
            loss, logs = self._loss_and_logs(data, compiled, resolved=step is not None)
            scaled = self.optimizer.scale_loss(loss)
        row_variables = [table.gradient_variables() for table in tables]
        gradients = tape.gradient(scaled, variables + sum(row_variables, []))
        rest = gradients[len(variables) :]
        for table, held in zip(tables, row_variables, strict=True):
            table.train_rows(rest[: len(held)], step, note_changes=step is None)
            rest = rest[len(held) :]
        if step is not None:  # the workers share the optimiser: the coordinator counts
            self.optimizer.iterations.assign(tf.cast(step, tf.int64) - 1)
        self.optimizer.apply(gradients[: len(variables)], variables)
        if step is None:
            self.step.assign_add(1)
        return {"loss": loss, **logs}

    def _make_sink_call(self, stacked, probing: list, inputs: tuple) -> Callable:
        """A graph function running `num_steps` steps over stacked batches, each after
        the `probing` callbacks' probes of it (`sink_calls.steps_with_probes`); returns
        the sum of each logged scalar and the probes' outputs. It is traced once for
        any number of steps, any batch size (a partial batch from a quiet stream must
        not stall training for a retrace) and any length of the probes' inputs."""
        jit = self.boost_level == "O2"
        resolvable = hasattr(self.network, "resolve")
        compiled = None
        if jit and resolvable:
            compiled = traced(
                lambda data: self._call(self.network, data, True),
                jit_compile=True,
                reduce_retracing=True,
            )

        def step(data):
            return self._train_step(data, compiled)

        if jit and not resolvable:
            step = traced(step, jit_compile=True, reduce_retracing=True)

        signature = tf.nest.map_structure(
            lambda t: tf.TensorSpec([None, None, *t.shape[2:]], t.dtype), stacked
        )

        def call(stacked, num_steps, inputs):
            return sink_calls.steps_with_probes(
                lambda index: step(tf.nest.map_structure(lambda t: t[index], stacked)),
                probing,
                inputs,
                num_steps,
            )

        return traced(
            call,
            input_signature=[signature, tf.TensorSpec([], tf.int32), sink_calls.any_length(inputs)],
        )

    # -- the loops -----------------------------------------------------------

    def online_train(
        self,
        train_dataset: Iterable,
        callbacks: list | None = None,
        dataset_sink_mode: bool = True,
        sink_size: int = 1,
    ) -> dict:
        """Trains on an unbounded dataset until it ends, a callback stops training,
        or SIGINT/SIGTERM arrives (module docstring).

        Args:
            train_dataset: A ``tf.data.Dataset`` (read without tf.data's autotuning:
                give its parallelism), a Python iterable or a stream of `StreamBatch`
                (optionally None while quiet).
            callbacks: Keras-style callbacks (see `callbacks.py` for ready-made ones).
            dataset_sink_mode: Run `sink_size` steps per graph call and call step-end
                callbacks once per sink.
            sink_size: Steps per sink, any positive number.
        Returns:
            ``steps``, ``events``, ``seconds``, ``stopped_by`` and the last logs.
        """
        if sink_size <= 0:
            raise ValueError(f"sink_size must be a positive number of steps, got {sink_size}")
        return self._train_loop(train_dataset, callbacks, sink_size if dataset_sink_mode else 1)

    def train(
        self,
        epoch: int,
        train_dataset: Iterable,
        callbacks: list | None = None,
        dataset_sink_mode: bool = True,
        sink_size: int = -1,
    ) -> dict:
        """Trains `epoch` passes over a finite dataset; `sink_size` -1 means a whole
        pass per sink (MindSpore's default)."""
        if sink_size == 0 or sink_size < -1:
            raise ValueError(f"sink_size must be positive or -1, got {sink_size}")
        size = sink_size if dataset_sink_mode and sink_size > 0 else 1
        if dataset_sink_mode and sink_size == -1:
            size = 2**31 - 1
        summary: dict = {}
        for index in range(epoch):
            summary = self._train_loop(train_dataset, callbacks, size, epoch_index=index)
            if summary["stopped_by"] != "end of data":
                break
        return summary

    def _train_loop(self, dataset, callbacks, steps_per_call: int, epoch_index=None) -> dict:
        if isinstance(dataset, tf.data.Dataset):
            # Else deleting each pass's iterator waits for the autotuning thread.
            dataset = without_autotuning(dataset)
        self._dataset = dataset
        callback_list = CallbackList(callbacks, self)
        self.stop_training = self.network.stop_training = False
        start, events, logs = time.perf_counter(), 0, {}
        stopped_by = "end of data"
        has_position = [False]
        # Stop signals are raised between sinks only (the one mechanism of both
        # trainers): the sink in flight finishes, on_train_end checkpoints.
        with signals.stop_on_signals():
            callback_list.on_train_begin({})
            if epoch_index is not None:
                callback_list.on_epoch_begin(epoch_index, {})
            groups = group_batches(
                iter(dataset), steps_per_call, has_position, callback_list.on_sink_read
            )
            prefetcher = Prefetcher(groups) if self.boost_level != "O0" else None
            sink_calls.freeze_long_lived()
            try:
                for group in prefetcher or groups:
                    if group is None:
                        callback_list.on_idle(logs)
                    else:
                        callback_list.on_sink_begin(group)
                        logs = self._run_group(group, callback_list.probing)
                        callback_list.on_sink_end(group)
                        if has_position[0]:
                            self.position = group.position
                        self.trained_ids = group.ids
                        events += group.num_events
                        logs.update(events=events, step=int(self.step.numpy()))
                        callback_list.on_train_batch_end(logs["step"], logs)
                    stopped_by = self._stop_reason()
                    if stopped_by:
                        break
                else:
                    stopped_by = "end of data"
            finally:
                if prefetcher is not None:
                    prefetcher.close()
                gc.unfreeze()
            logs.update(self.finish_steps())
            if epoch_index is not None:
                callback_list.on_epoch_end(epoch_index, logs)
            callback_list.on_train_end(logs)
        return {
            "steps": int(self.step.numpy()),
            "events": events,
            "seconds": time.perf_counter() - start,
            "stopped_by": stopped_by,
            "logs": logs,
        }

    def _stop_reason(self) -> str:
        try:
            signals.check()
        except signals.Interrupted as stop:
            return f"signal {stop.signum}"
        if self.stop_training or getattr(self.network, "stop_training", False):
            return "callback"
        return ""

    def _run_group(self, group: BatchGroup, probing: list) -> dict:
        """Trains on `group` after the `probing` callbacks' probes of its inputs."""
        self._build_optimizer()
        probing = [callback for callback in probing if callback in group.probe_inputs]
        inputs = tuple(group.probe_inputs[callback] for callback in probing)
        if self.cluster is not None:  # the probes here, then the steps on the workers
            num_steps = tf.constant(group.num_steps)
            outputs = self._sink_calls(sink_calls.probe_call, None, probing, inputs, num_steps)
            logs = self.cluster.run(group)
        else:
            stacked = tf.nest.map_structure(tf.convert_to_tensor, group.stacked)
            totals, outputs = self._sink_calls(
                self._make_sink_call, stacked, probing, inputs, tf.constant(group.num_steps)
            )
            logs = {key: float(value) / group.num_steps for key, value in totals.items()}
        for callback, output in zip(probing, outputs, strict=True):
            group.probe_outputs[callback] = tf.nest.map_structure(lambda t: t.numpy(), output)
        return logs

    def eval(self, valid_dataset: Iterable, callbacks: list | None = None) -> dict[str, float]:
        """Evaluates `metrics` over a finite dataset of ``(data, label)`` batches (or of
        the eval network's inputs); returns ``{name: value}``."""
        for metric in self.metrics.values():
            metric.reset_state()
        if self._eval_call is None:
            self._eval_call = traced(self._eval_step, reduce_retracing=True)
        callback_list = CallbackList(callbacks, self)
        callback_list.on_test_begin({})
        for index, batch in enumerate(valid_dataset):
            data = batch.data if isinstance(batch, StreamBatch) else batch
            self._eval_call(data)
            callback_list.on_test_batch_end(index, {})
        results = {name: float(metric.result()) for name, metric in self.metrics.items()}
        callback_list.on_test_end(results)
        return results

    def _eval_step(self, data) -> None:
        if self.eval_network is not None:
            outputs = self._call(self.eval_network, data, False)
            loss, prediction, label = (outputs[i] for i in self.eval_indexes)
        else:
            features, label = data
            prediction = self._forward(features, False, None)
            loss = self.loss_fn(label, prediction) if self.loss_fn is not None else None
        prediction = tf.cast(prediction, tf.float32)
        for metric in self.metrics.values():
            if type(metric) is keras.metrics.Mean:  # the "loss" metric
                if loss is not None:
                    metric.update_state(loss)
            else:
                metric.update_state(label, prediction)
