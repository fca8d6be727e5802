"""The Estimator contract on TF2: a runner that owns model_dir and calls a model_fn.

``tf.estimator`` is gone from TensorFlow; this keeps its shape so benchmark code keeps
its structure: a ``model_fn(features, labels, mode, params, state)`` returning a spec,
and a runner with ``train(input_fn, steps)``, ``evaluate(input_fn, steps)`` and
``predict(features)`` (what a serving export wraps) that

- builds the variables once, under a ``tf.distribute`` strategy scope;
- checkpoints with ``tf.train.CheckpointManager`` and resumes from the latest
  checkpoint in ``model_dir`` unless asked to start clean; a model chosen as the best
  (on validation) is kept apart, in ``model_dir/best/``, beyond the manager's pruning;
- runs several steps per ``tf.function`` call (``steps_per_call``), optionally
  XLA-compiled, to cut Python overhead;
- splits each global batch of the input into per-replica slices itself, so static
  shapes hold on every replica and evaluation blocks never straddle replicas;
- honours SIGINT/SIGTERM between graph calls only (`signals.check`), never inside
  one, and ends the input pipeline before anything unwinds further.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable

import keras
import tensorflow as tf
from absl import logging

from official.core import distribution_utils, signals, writer_lease
from official.core.model_dir import ModelDirError, restore_latest, save_checkpoint

BEST_FOLDER = "best"  # under model_dir: the checkpoint `Runner.save_best` keeps


class Mode(enum.Enum):
    """The reference's ``tf.estimator.ModeKeys``."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclasses.dataclass
class ModelState:
    """The objects holding variables (TF2 keeps them in objects, not in a graph)."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer | None = None


@dataclasses.dataclass
class ModelSpec:
    """What `model_fn` returns (the counterpart of ``tf.estimator.EstimatorSpec``).

    Attributes:
        mode: The mode it was built for.
        loss: TRAIN: this replica's share of the global mean loss (plus L2).
        train_op: TRAIN: the optimiser's update (already applied when eager).
        metrics: TRAIN, EVAL: this replica's sums over its batch, which the runner adds
            up across replicas and steps.
        summarize: TRAIN, EVAL: turns those totals into the metrics `Runner.train` and
            `Runner.evaluate` report (means, rates), the part of the contract that
            ``eval_metric_ops`` held: the runner knows no metric by name. A pure Python
            function of floats; the default reports the totals as they are.
        predictions: PREDICT: what the model serves.
    """

    mode: Mode
    loss: tf.Tensor | None = None
    train_op: object = None
    metrics: dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)
    summarize: Callable[[dict[str, float]], dict[str, float]] = dict
    predictions: dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)


def without_autotuning(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` without tf.data's autotuning, for every pipeline a trainer iterates.

    The autotuning model thread is not woken when an iterator is deleted: the deletion
    waits for its next optimisation, whose period doubles, so a long run's iterators
    went away seconds after they were deleted, and a throughput run reported a fraction
    of its rate (docs/benchmarks.md, "The step's kernels"). Pipelines that want
    parallelism set it (`data_pipeline`'s are fixed).
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def sum_over_steps(
    step: Callable[[tf.Tensor], dict[str, tf.Tensor]], num_steps: tf.Tensor
) -> dict[str, tf.Tensor]:
    """``step(0) + ... + step(num_steps - 1)``, key by key, in one graph call (at least
    one step): several steps per call cut Python's share of each step. Both trainers
    run their steps this way; what a step reads stays theirs (the Runner an iterator of
    a distributed tf.data pipeline, RecModel host batches stacked from its sources).

    As in Keras 3's ``fit``, the step is traced without AutoGraph (`traced`): control
    flow on tensors inside it is written with ``tf.cond`` and ``tf.while_loop``."""
    if not tf.inside_function():  # run eagerly: a step stays Python
        totals = step(tf.constant(0))
        for index in range(1, int(num_steps)):
            logs = step(tf.constant(index))
            totals = {key: totals[key] + logs[key] for key in totals}
        return totals
    # One trace of the step, called twice (its first call gives the totals their
    # structure): the graph holds the step once, not twice, which halves tracing and
    # graph optimisation at start-up.
    step = traced(step)
    totals = step(tf.constant(0))

    def next_step(index, totals):
        logs = step(index)
        return index + 1, {key: totals[key] + logs[key] for key in totals}

    num_steps = tf.convert_to_tensor(num_steps, tf.int32)
    _, totals = tf.while_loop(
        lambda index, _: index < num_steps, next_step, (tf.constant(1), totals)
    )
    return totals


def traced(function: Callable, **options) -> Callable:
    """``tf.function(function, **options)`` without AutoGraph, as Keras 3 traces its
    steps: the trainers' graph code builds its control flow itself, and converting it
    cost about a third of each trace (seconds at every start)."""
    return tf.function(function, autograph=False, **options)


def weights_checkpoint(model: keras.Model, **others) -> tf.train.Checkpoint:
    """A checkpoint of `model`'s weights as a list (what `Runner.save_best` keeps): Keras
    keeps layers held in a Python list out of TensorFlow's object graph (NeuMF registers
    its MLP layers as attributes for that reason; a model given to the Runner may not)."""
    return tf.train.Checkpoint(weights=list(model.weights), **others)


def restore_model(model: keras.Model, model_dir: str, best: bool = False) -> str | None:
    """Restores only `model`'s weights from the newest intact checkpoint a Runner wrote
    in `model_dir` (with `best`, the one `Runner.save_best` kept): one run's trained
    model starting another, whose optimiser and epochs are its own. Returns the
    checkpoint's path, or None when there is none.

    Raises:
        ModelDirError: The checkpoint does not fit `model`, or every checkpoint there is
            damaged.
    """
    if best:
        directory = os.path.join(model_dir, BEST_FOLDER)
        return restore_latest(lambda: weights_checkpoint(model), directory)
    return restore_latest(lambda: tf.train.Checkpoint(model=model), model_dir)


def completed_epochs_of(checkpoint_path: str) -> int:
    """The epochs a Runner checkpoint holds, read without building the model."""
    reader = tf.train.load_checkpoint(checkpoint_path)
    # The checkpoint key of `Runner.completed_epochs` (its attribute name below).
    return int(reader.get_tensor("completed_epochs/.ATTRIBUTES/VARIABLE_VALUE"))


class Runner:
    """Trains and evaluates one model in `model_dir`, and predicts with it.

    Args:
        model_fn: ``(features, labels, mode, params, state) -> ModelSpec``.
        build_state: ``params -> ModelState``; called once inside the strategy scope.
        params: Passed to both.
        model_dir: Checkpoints live here (written by the chief only).
        strategy: The ``tf.distribute`` strategy.
        steps_per_call: Steps per ``tf.function`` call (training and evaluation).
        jit_compile: Compile the per-replica step with XLA.
        keep_checkpoints: Checkpoints kept by the manager.
        run_eagerly: Run the steps as plain Python, no graphs (debugging).
        accelerator_input: Feed even CPU replicas the way accelerators are fed
            (distributed input, fetched to the device): tests run that path this way.
    """

    def __init__(
        self,
        model_fn: Callable[..., ModelSpec],
        build_state: Callable[..., ModelState],
        params,
        model_dir: str,
        strategy: tf.distribute.Strategy,
        steps_per_call: int = 1,
        jit_compile: bool = False,
        keep_checkpoints: int = 3,
        run_eagerly: bool = False,
        accelerator_input: bool = False,
    ) -> None:
        self.model_fn = model_fn
        self.params = params
        self.model_dir = model_dir
        self.strategy = strategy
        self.steps_per_call = steps_per_call
        self.jit_compile = jit_compile and not run_eagerly
        self.run_eagerly = run_eagerly
        self.accelerator_input = accelerator_input
        self.is_chief = distribution_utils.is_chief(strategy)
        with strategy.scope():
            self.state = build_state(params)
            if self.state.optimizer is not None:
                self.state.optimizer.build(self.state.model.trainable_variables)
            self.completed_epochs = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="completed_epochs"
            )
        self._checkpoint = self._new_checkpoint()
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, self._checkpoint_dir(), max_to_keep=keep_checkpoints
        )
        self._best_manager: tf.train.CheckpointManager | None = None
        self.restored_from: str | None = None  # the checkpoint `restore` restored
        self._calls: dict[Mode, Callable] = {}  # each mode's call, made at its first use
        # Each mode's `ModelSpec.summarize`, taken from the spec when the step is traced.
        self._summarize: dict[Mode, Callable[[dict[str, float]], dict[str, float]]] = {}

    @property
    def global_step(self) -> int:
        return int(self.state.optimizer.iterations.numpy()) if self.state.optimizer else 0

    # -- checkpoints --------------------------------------------------------

    def _new_checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(
            model=self.state.model,
            optimizer=self.state.optimizer,
            completed_epochs=self.completed_epochs,
        )

    def _checkpoint_dir(self, folder: str = "") -> str:
        """Where this task writes its checkpoints (`folder` below it, if given)."""
        if self.is_chief:
            directory = self.model_dir
        else:
            # Every worker must take part in saving; only the chief's copy is kept.
            task = self.strategy.cluster_resolver.task_id
            directory = os.path.join(self.model_dir, f".worker_temp_{task}")
        return os.path.join(directory, folder) if folder else directory

    def restore(self) -> bool:
        """Restores the newest intact checkpoint in model_dir, if any (a damaged one is
        named and passed over: `restore_latest`); True if one was found. Its path is
        kept in `restored_from`.

        Raises:
            ModelDirError: The checkpoint does not fit this model (other model flags
                or other data), or every checkpoint there is damaged.
        """
        manager = self._manager if self.is_chief else None  # it saves in model_dir
        latest = restore_latest(self._new_checkpoint, self.model_dir, manager)
        if latest is None:
            return False
        self.restored_from = latest
        logging.info(
            "Resumed from %s (step %d, %d epochs done)",
            latest,
            self.global_step,
            int(self.completed_epochs.numpy()),
        )
        return True

    def save_checkpoint(self) -> str | None:
        """Writes a checkpoint numbered by the global step (all workers must call).

        Raises:
            ModelDirError: It could not be written (`model_dir.save_checkpoint`).
        """
        return self._save(self._manager)

    def _save(self, manager: tf.train.CheckpointManager) -> str | None:
        writer_lease.check_held(manager.directory)
        path = save_checkpoint(manager, self.global_step)
        if not self.is_chief:
            tf.io.gfile.rmtree(self._checkpoint_dir())
            return None
        return path

    def save_best(self) -> str | None:
        """Keeps the model as it is now as the best one, in ``model_dir/best/`` (all
        workers must call): the per-cycle checkpoints are pruned to `keep_checkpoints`,
        a model chosen on validation must outlive them. One is kept, the last saved;
        it holds the weights and `completed_epochs` (what evaluation and export need).

        Raises:
            ModelDirError: It could not be written (`model_dir.save_checkpoint`).
        """
        if self._best_manager is None:
            kept = weights_checkpoint(self.state.model, completed_epochs=self.completed_epochs)
            self._best_manager = tf.train.CheckpointManager(
                kept, self._checkpoint_dir(BEST_FOLDER), max_to_keep=1
            )
        return self._save(self._best_manager)

    def restore_best(self) -> str:
        """Restores the weights `save_best` kept (not the optimiser, nor the epoch
        count: training does not go on from them); returns the checkpoint's path.

        Raises:
            ModelDirError: None was kept, it does not fit this model, or it is damaged.
        """
        path = restore_model(self.state.model, self.model_dir, best=True)
        if path is None:
            directory = os.path.join(self.model_dir, BEST_FOLDER)
            raise ModelDirError(
                f"no best checkpoint in {directory}; start over with --clean or another --model_dir"
            )
        return path

    # -- input --------------------------------------------------------------

    def distribute(self, input_fn: Callable[[], tf.data.Dataset]):
        """Distributes global batches: replica r of R gets slice r of each batch.

        On accelerators and with several replicas the batches go through
        `distribute_datasets_from_function`, prefetched to the devices; one CPU replica
        reads the plain dataset, unless `accelerator_input` asks for the accelerators'
        path (so that CPU tests run it).
        """
        replicas = self.strategy.num_replicas_in_sync
        to_device = self._on_accelerator() or self.accelerator_input
        if replicas == 1 and not to_device:
            # One CPU replica needs no distribution. tf.distribute would read through a
            # multi-device iterator whose per-device tf.data autotuning thread is not
            # woken when the iterator is deleted: each cycle's iterator then took seconds
            # to go away in most cold runs (docs/benchmarks.md, "The step's kernels").
            return without_autotuning(input_fn())

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            dataset = without_autotuning(input_fn())
            if replicas == 1:
                return dataset
            local = context.num_replicas_in_sync // context.num_input_pipelines
            first = context.input_pipeline_id * local

            def slices(*batch):
                parts = tf.nest.map_structure(
                    lambda t: tf.reshape(t, [replicas, -1])[first : first + local], batch
                )
                return tf.data.Dataset.from_tensor_slices(parts if len(batch) > 1 else parts[0])

            return dataset.flat_map(slices)

        # Prefetching to the device pays on accelerators only.
        options = tf.distribute.InputOptions(experimental_fetch_to_device=to_device)
        return self.strategy.distribute_datasets_from_function(dataset_fn, options)

    def _on_accelerator(self) -> bool:
        return distribution_utils.device_types(self.strategy) != {"CPU"}

    # -- train / evaluate ---------------------------------------------------

    def _step(self, mode: Mode):
        def step(batch):
            features, labels = batch if mode == Mode.TRAIN else (batch, None)
            spec = self.model_fn(features, labels, mode, self.params, self.state)
            # Python runs this while tracing (eagerly: at every step), so the spec's
            # reduction of the totals is known by the time the first call returns.
            self._summarize[mode] = spec.summarize
            return spec.metrics

        return traced(step, jit_compile=self.jit_compile) if self.jit_compile else step

    def _make_call(self, mode: Mode):
        step = self._step(mode)
        strategy = self.strategy

        def call(iterator, num_steps):
            def global_step(_):
                per_replica = strategy.run(step, args=(next(iterator),))
                return {
                    key: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                    for key, value in per_replica.items()
                }

            return sum_over_steps(global_step, num_steps)

        return call if self.run_eagerly else traced(call)

    def train(
        self,
        input_fn: Callable[[], tf.data.Dataset],
        steps: int,
        on_progress: Callable[[int, dict], None] | None = None,
    ) -> dict[str, float]:
        """Runs `steps` training steps over ``input_fn()``.

        Args:
            input_fn: Returns a dataset of global ``(features, labels)`` batches.
            steps: Steps (global batches) to run.
            on_progress: Called after each call with (steps done, metric sums so far).
        Returns:
            The TRAIN spec's summary of the metric sums (`ModelSpec.summarize`), and
            ``seconds``.
        """
        return self._run(Mode.TRAIN, self._call(Mode.TRAIN), input_fn, steps, on_progress)

    def evaluate(self, input_fn: Callable[[], tf.data.Dataset], steps: int) -> dict[str, float]:
        """Evaluates over `steps` batches; returns the EVAL spec's summary of the metric
        sums (`ModelSpec.summarize`), and ``seconds``."""
        return self._run(Mode.EVAL, self._call(Mode.EVAL), input_fn, steps, None)

    def prepare(self, mode: Mode, element_spec: object) -> None:
        """Gets `mode`'s call ready before its data exists (a trainer does this while it
        waits for data): traced for batches of `element_spec`, and for EVAL, which
        changes no state, also compiled by one call on zeros, so that its first real
        call only runs (TRAIN's still compiles with XLA: a call would train).
        `element_spec` is the input dataset's: a nest of fully defined `tf.TensorSpec`s."""
        call = self._call(mode)
        if self.run_eagerly:
            return
        batch = tf.nest.map_structure(lambda spec: tf.zeros(spec.shape, spec.dtype), element_spec)
        dataset = tf.data.Dataset.from_tensors(batch).repeat()
        # `distribute` makes the real input's iterator the same way: the same type.
        iterator = iter(self.distribute(lambda: dataset))
        if mode == Mode.EVAL:
            call(iterator, tf.constant(1))
        else:
            call.get_concrete_function(iterator, tf.TensorSpec([], tf.int32))

    def _call(self, mode: Mode):
        if mode not in self._calls:
            self._calls[mode] = self._make_call(mode)
        return self._calls[mode]

    def _run(self, mode: Mode, call, input_fn, steps, on_progress) -> dict[str, float]:
        """`steps` steps in calls of `steps_per_call`; a stop signal is raised between
        calls."""
        start = time.perf_counter()
        iterator = iter(self.distribute(input_fn))
        sums: dict[str, float] = {}
        done = 0
        try:
            while done < steps:
                signals.check()
                count = min(self.steps_per_call, steps - done)
                result = call(iterator, tf.constant(count))
                for key, value in result.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                done += count
                if on_progress is not None:
                    on_progress(done, sums)
        finally:
            # Ends the input pipeline's reader threads now, not whenever the frame
            # holding the iterator is freed (an exception's traceback keeps it).
            del iterator
        metrics = self._summarize.get(mode, dict)(sums)
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # -- predict ------------------------------------------------------------

    def predict(self, features: dict) -> dict[str, tf.Tensor]:
        """`model_fn`'s PREDICT predictions for `features`, with this runner's variables."""
        state = ModelState(self.state.model)
        return self.model_fn(features, None, Mode.PREDICT, self.params, state).predictions
