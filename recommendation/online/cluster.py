"""Online training on several machines: tf.distribute's parameter-server engine.

The cluster is the one ``TF_CONFIG`` describes (the tf.distribute convention): a
``chief`` (the coordinator: ``ncf-online`` itself), ``ps`` tasks and ``worker`` tasks,
each a ``tf.distribute.Server`` (`serve`).

- The ps tasks hold the model: each table's rows and their Adam moments are split over
  them (`row_shards`: row r on task r mod N, so each holds 1/N of every table), the
  dense weights and their slots are placed by `tf.distribute.ParameterServerStrategy`.
- The coordinator keeps each table's index (id to row) and policy state, about 150
  bytes an id (`docs/cluster.md`): it reads the stream, resolves each batch's ids to
  rows (admission, eviction, the prequential test rows), and schedules the step on a
  worker with `ClusterCoordinator.schedule`, sending the row numbers; it checkpoints, acknowledges
  and exports after joining the steps in flight (`ClusterSteps.finish`), so a
  checkpoint covers every step it counts.
- Workers run the steps: gather the rows from the ps tasks, score, and apply the
  gradients there (lazy Adam on the rows, Adam on the dense weights).

Steps run asynchronously, as on any parameter server: up to `max_in_flight` steps at
once, each computing its gradient on weights that the others may have moved. The
index is only ever changed by the coordinator, one step at a time, so every id has one
row, on one task; and no step's update lands on a row that another id holds by the
time it is applied: whatever changes which id a row holds, where an id's row is, or
the row variables (eviction, expiry, growth) waits until no step is in flight
(`steps_in_flight`).

A worker that dies is the coordinator's to handle: `ClusterCoordinator` runs its steps
again on the others (a step may thus be applied twice: at least once), and with none
alive waits for one to come back (`reporting_waits` says so). A ps task that dies ends
the run with an `error:` line; after it, or after the coordinator dies, the same
commands restart the cluster from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import tensorflow as tf
from absl import logging

from official.core.runner import traced

TASK_TYPES = ("ps", "worker")


class ClusterError(ValueError):
    """TF_CONFIG does not describe a cluster this command can be part of, or a task of
    the cluster is lost."""


def lost_task(error: tf.errors.OpError) -> str:
    """The task an error from the cluster names (``ps task 0``), or ``a task of the
    cluster``."""
    found = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", error.message or "")
    return f"{found.group(1)} task {found.group(2)}" if found else "a task of the cluster"


def cluster_resolver() -> tf.distribute.cluster_resolver.TFConfigClusterResolver | None:
    """The cluster of ``TF_CONFIG``, checked; None when there is none (one process)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ClusterError(f"TF_CONFIG is not JSON ({error}): fix the variable") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterError('TF_CONFIG has no "cluster": give {"cluster": ..., "task": ...}')
    missing = [job for job in ("chief", "ps", "worker") if not cluster.get(job)]
    if missing:
        raise ClusterError(
            f"TF_CONFIG's cluster has no {', '.join(missing)} task: online training needs "
            'one "chief" (the ncf-online that trains), "ps" tasks and "worker" tasks'
        )
    if len(cluster["chief"]) != 1:
        raise ClusterError(f"TF_CONFIG's cluster has {len(cluster['chief'])} chiefs: give one")
    task = config.get("task")
    if not isinstance(task, dict) or task.get("type") not in cluster:
        raise ClusterError(
            f'TF_CONFIG\'s "task" must name a job of the cluster ({", ".join(cluster)}) '
            f"and an index, got {task!r}"
        )
    index = task.get("index", 0)
    if not isinstance(index, int) or not 0 <= index < len(cluster[task["type"]]):
        raise ClusterError(
            f"TF_CONFIG's task index {index!r} is not one of the {len(cluster[task['type']])} "
            f"{task['type']} tasks"
        )
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def serve(task_type: str) -> None:
    """Runs this process as the `task_type` server of TF_CONFIG's cluster, until killed.

    Raises:
        ClusterError: TF_CONFIG names no cluster, or another task for this process.
    """
    resolver = cluster_resolver()
    if resolver is None:
        raise ClusterError(
            f"--serve_as {task_type} needs TF_CONFIG naming the cluster and this task: "
            f'{{"cluster": {{...}}, "task": {{"type": "{task_type}", "index": N}}}}'
        )
    index = resolver.task_id or 0  # TF_CONFIG's index defaults to 0
    if resolver.task_type != task_type:
        raise ClusterError(
            f"--serve_as {task_type}, but TF_CONFIG's task is {resolver.task_type} "
            f"{index}: make them agree"
        )
    try:
        server = tf.distribute.Server(
            resolver.cluster_spec(),
            job_name=task_type,
            task_index=index,
            protocol="grpc",
            start=True,
        )
    except tf.errors.UnknownError as error:  # the port is taken
        address = resolver.cluster_spec().task_address(task_type, index)
        raise ClusterError(
            f"cannot serve {task_type} {index} at {address} "
            f"({error.message.splitlines()[0]}): free the port or fix TF_CONFIG"
        ) from None
    logging.info("serving as %s %d at %s", task_type, index, server.target)
    print(f"serving as {task_type} {index} at {server.target}", flush=True)
    server.join()


@dataclasses.dataclass(frozen=True)
class Connection:
    """The coordinator's hold on its cluster.

    Attributes:
        coordinator: Schedules the steps (its ``strategy`` places the dense weights).
        ps_devices: One device per ps task, in task order (the tables' shards).
        num_workers: Worker tasks.
    """

    coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator
    ps_devices: list[str]
    num_workers: int


def wait_for_tasks(spec: tf.train.ClusterSpec, seconds: float, poll: float = 0.2) -> None:
    """Waits until every ps and worker task of `spec` accepts connections (TensorFlow's
    own connection would wait for a missing one silently, for ever), saying which it
    waits for every 10 s.

    Raises:
        ClusterError: A task still does not answer after `seconds`.
    """
    start = said = time.monotonic()
    for kind in TASK_TYPES:
        for index, address in enumerate(spec.job_tasks(kind)):
            host, port = address.rsplit(":", 1)
            while True:
                try:
                    with socket.create_connection((host, int(port)), timeout=1):
                        break
                except OSError:
                    waited = time.monotonic() - start
                    if waited >= seconds:
                        raise ClusterError(
                            f"{kind} task {index} at {address} does not answer after "
                            f"{seconds:g} s: start it (ncf-online --serve_as {kind} with its "
                            "TF_CONFIG), or fix the address in TF_CONFIG"
                        ) from None
                    if time.monotonic() - said >= 10:
                        logging.info("waiting for %s task %d at %s", kind, index, address)
                        said = time.monotonic()
                    time.sleep(poll)


def connect(
    resolver: tf.distribute.cluster_resolver.TFConfigClusterResolver, wait_seconds: float
) -> Connection:
    """Connects to `resolver`'s cluster as its coordinator, once every task answers
    (waiting up to `wait_seconds` for them).

    Raises:
        ClusterError: This process is not TF_CONFIG's chief, or a task does not answer.
    """
    if resolver.task_type != "chief":
        raise ClusterError(
            f"TF_CONFIG's task is {resolver.task_type} {resolver.task_id or 0}: ncf-online trains "
            "as the chief; start ps and worker tasks with --serve_as ps|worker"
        )
    spec = resolver.cluster_spec()
    wait_for_tasks(spec, wait_seconds)
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    return Connection(
        tf.distribute.coordinator.ClusterCoordinator(strategy),
        [f"/job:ps/replica:0/task:{index}/device:CPU:0" for index in range(spec.num_tasks("ps"))],
        spec.num_tasks("worker"),
    )


@contextlib.contextmanager
def reporting_waits(what: str, every_seconds: float = 60.0) -> Iterator[None]:
    """Warns every `every_seconds` while the block waits for `what`: a wait on the
    workers has no end of its own (`ClusterCoordinator` runs a dead worker's steps on
    the others, and with none alive waits for one to come back)."""
    done = threading.Event()
    start = time.monotonic()

    def warn() -> None:
        while not done.wait(every_seconds):
            logging.warning(
                "waited %.0f s for %s: is any worker task alive? (start the dead ones again "
                "with their TF_CONFIG; training goes on when one answers)",
                time.monotonic() - start,
                what,
            )

    watcher = threading.Thread(target=warn, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class ClusterTraining:
    """Mixed into `RecModel`: `distribute` and `finish_steps`.

    The host provides ``network`` (with ``resolve``, ``trained_rows`` and
    ``looked_up_ids``),
    ``optimizer``, ``loss_fn``, ``step``, ``cluster`` (None in one process),
    `_build_optimizer` and `_train_step`.
    """

    def distribute(
        self,
        coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator,
        max_in_flight: int,
    ) -> None:
        """Runs the training steps on the workers of `coordinator`'s cluster: the
        network's ``resolve`` here, the rest of each step on a worker (`cluster`). The
        network's dense weights and the optimiser must have been built in the
        strategy's scope, and its row tables sharded over the ps tasks."""
        resolve = getattr(self.network, "resolve", None)
        if resolve is None or self.optimizer is None or self.loss_fn is not None:
            raise ValueError(
                "a cluster trains a network with a resolve stage that computes its own "
                "loss, with an optimizer"
            )
        self._build_optimizer()
        for table in self.row_tables():
            table.drain_for_changes()

        def resolve_step(data):
            resolved = resolve(data, training=True)
            for table, slots in self.network.trained_rows(resolved):
                table.note_trained(slots)
            return resolved, self.step.assign_add(1)

        def train(resolved, step):
            return self._train_step(resolved, None, step)

        self.cluster = ClusterSteps(
            coordinator, resolve_step, train, max_in_flight, self.network.looked_up_ids
        )

    def finish_steps(self) -> dict[str, float]:
        """Waits for the steps in flight on a cluster; their mean logs ({} in one
        process)."""
        return self.cluster.finish() if self.cluster is not None else {}


class ClusterSteps:
    """A RecModel's training steps on a cluster's workers (`RecModel.distribute`).

    Args:
        coordinator: The cluster's coordinator.
        resolve: ``data -> (resolved, step)``: the coordinator's part of a step (ids
            to rows, the step count); run here.
        train: ``(resolved, step) -> logs``: a worker's part, run in a replica
            context of the coordinator's strategy.
        max_in_flight: Most steps scheduled and not finished; more waits for the
            oldest (the stream is read no faster than the workers train).
        looked_up: ``data -> [(table, ids)]``: the ids a step looks up in each hash
            table, whose changes wait for the steps in flight (`steps_in_flight`).
    """

    def __init__(
        self,
        coordinator: tf.distribute.experimental.coordinator.ClusterCoordinator,
        resolve: Callable,
        train: Callable,
        max_in_flight: int,
        looked_up: Callable,
    ) -> None:
        self.coordinator = coordinator
        self.looked_up = looked_up
        strategy = coordinator.strategy
        self._resolve = traced(resolve, reduce_retracing=True)
        self._train = traced(
            lambda resolved, step: strategy.run(train, args=(resolved, step)),
            reduce_retracing=True,
        )
        self.max_in_flight = max_in_flight
        self._in_flight: list = []
        self.last_logs: dict[str, float] = {}  # of the steps that finished last
        # Seconds spent resolving, scheduling and waiting for the workers, over the
        # steps after the first (whose tracing would swamp them), and those steps.
        self.seconds = {"resolve": 0.0, "schedule": 0.0, "wait": 0.0}
        self.timed_steps = -1
        self.drains = 0  # waits for every step in flight before a step that changes rows

    def run(self, group) -> dict[str, float]:
        """Schedules one step per batch of `group` (`stream_batches.BatchGroup`);
        returns the mean logs of the steps that finished meanwhile (those of the last
        to finish before, when none did)."""
        finished = []
        for index in range(group.num_steps):
            batch = tf.nest.map_structure(lambda t, i=index: t[i], group.stacked)
            due = [(t, ids) for t, ids in self.looked_up(batch) if t.upkeep_due(ids)]
            if due:  # it changes rows: no step may be in flight
                finished += [self._fetch_oldest() for _ in range(len(self._in_flight))]
                self.drains += 1
                for table, ids in due:
                    table.upkeep(len(ids))
            data = tf.nest.map_structure(tf.convert_to_tensor, batch)
            start = time.perf_counter()
            resolved, step = self._resolve(data)
            scheduled = time.perf_counter()
            self._in_flight.append(self.coordinator.schedule(self._train, args=(resolved, step)))
            done = time.perf_counter()
            self.timed_steps += 1
            if self.timed_steps:
                self.seconds["resolve"] += scheduled - start
                self.seconds["schedule"] += done - scheduled
            while len(self._in_flight) > self.max_in_flight:
                finished.append(self._fetch_oldest())
        return self._logs(finished)

    def finish(self) -> dict[str, float]:
        """Waits for every step in flight; returns their mean logs."""
        start = time.perf_counter()
        with reporting_waits("the steps in flight"):
            self.coordinator.join()
        self._waited(start)
        finished = [self._fetch_oldest() for _ in range(len(self._in_flight))]
        return self._logs(finished)

    def _logs(self, finished: list[dict]) -> dict[str, float]:
        if finished:
            self.last_logs = {
                key: sum(float(logs[key]) for logs in finished) / len(finished)
                for key in finished[0]
            }
        return dict(self.last_logs)

    def _fetch_oldest(self) -> dict:
        start = time.perf_counter()
        with reporting_waits("a step"):
            logs = self._in_flight.pop(0).fetch()
        self._waited(start)
        return logs

    def _waited(self, start: float) -> None:
        if self.timed_steps > 0:
            self.seconds["wait"] += time.perf_counter() - start

    def ms_per_step(self) -> dict[str, float]:
        """Mean milliseconds a step spent resolving, scheduling and waiting (the first
        step left out)."""
        steps = max(self.timed_steps, 1)
        return {key: 1e3 * value / steps for key, value in self.seconds.items()}
