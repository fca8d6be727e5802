"""Trains NeuMF online from an event stream (``python -m recommendation.online_main``).

    REDIS_PASSWORD=... python -m recommendation.online_main \\
        --redis_url redis://localhost:6379/0 --stream events \\
        --model_dir /tmp/ncf-online --export_dir /tmp/ncf-online/export
    python -m recommendation.online_main --kafka_servers localhost:9092 \\
        --kafka_topic events --model_dir ...
    python -m recommendation.online_main --events_dir /data/events --model_dir ...

Users and items get hash-embedding rows as they appear; one event in
--prequential_every is scored by the prequential protocol (`prequential`) before its
batch trains with --num_neg negatives per event. Checkpoints (with the stream
position; full every --full_checkpoint_every, deltas between) come by step or time,
and only once one is on disk are its events acknowledged to Redis (or its offsets
committed as the Kafka group's); SavedModels are exported atomically. SIGINT/SIGTERM
finishes the step, checkpoints, acknowledges and exits. Redis and Kafka credentials are
`redis_connection`'s and `kafka_connection`'s (never printed); a password refused while
training stops the run with one error line. The Kafka client is imported only for a
Kafka source (the ``kafka`` extra). Flags are read here only;
`OnlineConfig` carries them inward (docs/online.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import redis
import tensorflow as tf
from absl import app, flags, logging

from official.core import distribution_utils, model_dir, writer_lease
from official.core.model_dir import ModelDirError
from official.utils.flags import THREAD_FLAGS, core
from official.utils.flags.core import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_OR_UNSET,
    STEP_RANGE_OR_UNSET,
    FlagSpec,
    Rule,
)
from official.utils.logs.summaries import ScalarSummaries
from official.utils.misc import atomic, errors
from recommendation.model.hyperparams import ModelParams
from recommendation.online import (
    callbacks,
    cluster,
    model_flags,
    online_ncf,
    prequential,
    run_summary,
    step_stages,
)
from recommendation.online.callback_base import Callback
from recommendation.online.evaluation import PrequentialEvaluation
from recommendation.online.online_ncf import OnlineParams
from recommendation.online.rec_model import AMP_LEVELS, BOOST_LEVELS, RecModel
from recommendation.online.sources import group_claim, kafka_connection, redis_connection
from recommendation.online.sources.connect import make_source
from recommendation.online.sources.event_stream import EventStream
from recommendation.online.sources.kafka_connection import KafkaAccessError, KafkaOptions
from recommendation.online.sources.redis_connection import RedisAccessError, RedisOptions
from recommendation.online.state import serving_export
from recommendation.serving import publication_channels
from recommendation.training import ncf_flags


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    """One online training run (built from flags by `config_from_flags`); its defaults
    are the flags' defaults.

    Attributes:
        redis: The Redis to read from (its URL, credentials and TLS files).
        stream, consumer: The Redis stream and consumer.
        group, share_group: The consumer group (Redis or Kafka), and whether other
            readers share it (then it is not claimed).
        kafka: The Kafka brokers to read from (credentials and TLS files).
        kafka_topic, kafka_dead_letter_topic: The Kafka topic, and the topic of its
            dead letters (None: `dead_letter_file`).
        events_dir: The event-folder source.
        dead_letter_file: Dead letters of the folder or Kafka source.
        model_dir, clean: Checkpoints (resumed unless `clean`).
        export_dir, keep_exports: Serving exports (versions) and how many to keep.
        model: Network, hash tables, sampling and optimiser settings.
        prequential_every, prequential_negatives, prequential_window_events, top_k: The
            prequential protocol (`prequential.Prequential`'s every, negatives,
            window_events and top_k).
        batch_size: Events per training step.
        sink_size: Steps per graph call.
        amp_level, boost_level: RecModel precision and speed-up levels.
        inter_op_threads, intra_op_threads: TensorFlow's thread pools (0: its choice);
            one thread inside an op: splitting a step's small ops cost more than it saved.
        linger_seconds: Longest wait for a batch to fill before training a partial one.
        checkpoint_every_steps, checkpoint_every_secs: Checkpoint cadence.
        full_checkpoint_every: Every how many checkpoints one is full (the others are
            deltas, `delta_checkpoints`).
        export_every_steps, export_every_secs: Version cadence (also once the
            publications since the last version add up to its size).
        publish_every_secs: Publication cadence: what changed since the last one, for
            servers to apply in place (`publishing`; 0: none).
        publication_channel: Publish to this Kafka topic or Redis stream of the source's
            broker instead of ``EXPORT_DIR/publications/`` (`publication_channels`).
        log_every_secs: Metric log cadence.
        max_events, max_seconds, idle_timeout_secs: Stop conditions (None: none).
        trained_events_log: Append the source id of every trained event here (audit).
        summary_file: Write the run summary (with the metric history) here as JSON.
        profile_steps: ``(first, last)``: profile those steps into MODEL_DIR/profile
            (`step_stages.ProfileSteps`); empty: none.
        seed: Fixes initial weights and sampling.
        serve_as: Be this task (``ps`` or ``worker``) of TF_CONFIG's cluster instead.
        cluster_wait_secs: How long the chief waits for the cluster's tasks to answer.
    """

    redis: RedisOptions = RedisOptions()
    stream: str = "events"
    group: str = "trainer"
    consumer: str = "trainer-0"
    share_group: bool = False
    kafka: KafkaOptions = KafkaOptions()
    kafka_topic: str = "events"
    kafka_dead_letter_topic: str | None = None
    events_dir: str | None = None
    dead_letter_file: str | None = None
    model_dir: str = "/tmp/ncf-online"
    clean: bool = False
    export_dir: str | None = None
    keep_exports: int = 3
    model: OnlineParams = OnlineParams()
    prequential_every: int = 8
    prequential_negatives: int = 99
    prequential_window_events: int = 100_000
    top_k: int = ModelParams.top_k
    batch_size: int = 4096
    sink_size: int = 4
    amp_level: str = "O0"
    boost_level: str = "O1"
    inter_op_threads: int = 0
    intra_op_threads: int = 1
    linger_seconds: float = 0.2
    checkpoint_every_steps: int | None = None
    checkpoint_every_secs: float | None = 30.0
    full_checkpoint_every: int = 10
    export_every_steps: int | None = None
    export_every_secs: float | None = 300.0
    publish_every_secs: float = 0.5
    publication_channel: str | None = None
    log_every_secs: float = 10.0
    max_events: int | None = None
    max_seconds: float | None = None
    idle_timeout_secs: float | None = None
    trained_events_log: str | None = None
    summary_file: str | None = None
    profile_steps: tuple[int, ...] = ()
    seed: int | None = None
    serve_as: str | None = None
    cluster_wait_secs: float = 300.0


def make_callbacks(config: OnlineConfig, channel=None) -> list[Callback]:
    """Audit log (first: an event is logged before a checkpoint can vouch for it),
    metrics (before the checkpoint and export, so that the last report, at the end,
    measures the training and not the durable save and export made when it stops),
    the tables watched, checkpoint, export (its publications to `channel`: None, the
    export folder) and stop conditions."""
    checkpoint = callbacks.CheckpointCallback(
        config.model_dir,
        config.checkpoint_every_steps,
        config.checkpoint_every_secs,
        full_every=config.full_checkpoint_every,
    )
    tables = callbacks.TableWatch()
    evaluation = PrequentialEvaluation(
        prequential.Prequential(
            config.prequential_every,
            config.prequential_negatives,
            config.top_k,
            window_events=config.prequential_window_events,
        )
    )
    chosen: list[Callback] = []
    if config.profile_steps:  # first: its profile holds the sink's scoring too
        profile_dir = os.path.join(config.model_dir, "profile")
        chosen.append(step_stages.ProfileSteps(*config.profile_steps, profile_dir))
    if config.trained_events_log:
        chosen.append(callbacks.TrainedEventsLog(config.trained_events_log))
    chosen.append(
        callbacks.MetricLogger(
            every_seconds=config.log_every_secs,
            gauges=lambda: {**evaluation.gauges(), **tables.gauges()},
            summaries=ScalarSummaries(config.model_dir),
        )
    )
    chosen += [evaluation, tables, checkpoint, callbacks.ReportRestore(checkpoint)]
    if config.export_dir:
        chosen.append(
            serving_export.ExportCallback(
                config.export_dir,
                config.export_every_steps,
                config.export_every_secs,
                config.keep_exports,
                config.publish_every_secs or None,
                channel,
            )
        )
    if config.max_events or config.max_seconds or config.idle_timeout_secs:
        chosen.append(
            callbacks.StopAfter(
                events=config.max_events,
                seconds=config.max_seconds,
                idle_seconds=config.idle_timeout_secs,
            )
        )
    return chosen


def run(config: OnlineConfig) -> dict:
    """Trains until a stop condition or signal; returns the run summary (whose
    ``dead_letters`` counts every run since a clean start: the count travels in the
    checkpointed stream position).

    Raises:
        ModelDirError: Another live process writes model_dir or export_dir (its lease
            names it), or one of them cannot be written.
    """
    if config.seed is not None:
        tf.keras.utils.set_random_seed(config.seed)
    model_dir.prepare(config.model_dir)
    if config.export_dir:
        model_dir.prepare(config.export_dir, "--export_dir", "exports")
    # Both leases before --clean empties model_dir: a run refused touches nothing.
    with (
        writer_lease.hold(config.model_dir, "ncf-online") as lease,
        writer_lease.hold_export(config.export_dir, "ncf-online"),
    ):
        if config.clean:
            lease.clear_folder()
        return _run_holding_model_dir(config)


def _run_holding_model_dir(config: OnlineConfig) -> dict:
    redis_access = redis_connection.resolve(config.redis) if config.redis.url else None
    kafka_access = kafka_connection.resolve(config.kafka) if config.kafka.servers else None
    resolver = cluster.cluster_resolver()
    connection = cluster.connect(resolver, config.cluster_wait_secs) if resolver else None
    rec_model: RecModel = online_ncf.build_rec_model(
        config.model, config.amp_level, config.boost_level, connection
    )
    source = make_source(config, redis_access, kafka_access)
    channel = publication_channels.make_channel(
        config.export_dir, config.publication_channel, redis_access, kafka_access
    )
    chosen = make_callbacks(config, channel)
    try:
        summary = rec_model.online_train(
            EventStream(source, config.batch_size, config.linger_seconds),
            chosen,
            dataset_sink_mode=True,
            sink_size=config.sink_size,
        )
    except redis.RedisError as error:
        # Refused once running (a password changed, a right withdrawn): retrying would
        # only repeat it, and a stopped trainer is seen where a retrying one looks alive.
        raise RedisAccessError(
            redis_access.explain(error, source.acl_rules())
            + "; training stopped, and the same command resumes from the last checkpoint"
        ) from None
    except (tf.errors.UnavailableError, tf.errors.AbortedError) as error:
        if connection is None:
            raise
        raise cluster.ClusterError(
            f"{cluster.lost_task(error)} stopped answering: restart it and this command; "
            "training resumes from the last checkpoint, whose events are the only ones "
            "acknowledged"
        ) from None
    finally:
        source.close()
    summary.update(
        dead_letters=source.dead_letters,
        lost_events=getattr(source, "lost_events", 0),
        lost_events_exact=getattr(source, "lost_events_exact", True),
        rewritten_files=getattr(source, "rewritten_files", None),
        rotated_files=getattr(source, "rotated_files", None),
        reconnects=getattr(source, "reconnects", 0),
        memory_wait_seconds=getattr(source, "memory_wait_seconds", 0.0),
        **run_summary.rates(chosen),
        cluster=run_summary.cluster_counts(rec_model),
        **run_summary.outputs(chosen),
    )
    if config.summary_file:
        atomic.write_file(config.summary_file, json.dumps(summary, sort_keys=True))
    return summary


# -- flags -------------------------------------------------------------------


# Every flag of ``online_main``, on `OnlineConfig` (which holds the defaults); the
# concepts it shares with ncf-main are ncf-main's flags.
ONLINE_FLAGS = (
    *core.under(redis_connection.REDIS_FLAGS, "redis"),
    FlagSpec("stream", "Redis stream key."),
    *core.under(kafka_connection.KAFKA_FLAGS, "kafka"),
    FlagSpec("kafka_topic", "Kafka topic; every partition is read."),
    FlagSpec(
        "kafka_dead_letter_topic",
        "Kafka topic of the malformed events (default: --dead_letter_file).",
    ),
    FlagSpec(
        "group",
        "Consumer group (Redis, or Kafka: its committed offsets show the trainer's lag); "
        "one model's (its trainer claims it).",
    ),
    FlagSpec(
        "share_group",
        "Other readers of --group train this model too: take no claim of the group.",
    ),
    FlagSpec("consumer", "Consumer name; keep it across restarts."),
    FlagSpec("events_dir", "Folder of append-only *.jsonl / *.csv event files."),
    FlagSpec(
        "dead_letter_file",
        "Malformed events from --events_dir or --kafka_servers (default "
        "MODEL_DIR/dead_letters.jsonl).",
    ),
    FlagSpec("model_dir", "Checkpoints.", short_name="md"),
    FlagSpec("clean", "Start over (delete model_dir)."),
    FlagSpec("export_dir", "Folder of SavedModel versions."),
    FlagSpec("keep_exports", "Export versions kept.", checks=(POSITIVE,)),
    FlagSpec("batch_size", "Events per training step.", checks=(POSITIVE,)),
    *core.at(ncf_flags.SHARED_FLAGS, num_neg="model.num_neg", top_k="top_k"),
    *model_flags.MODEL_FLAGS,
    FlagSpec(
        "prequential_every",
        "Score 1 event in this many (chosen by a hash of the event) before training on "
        "it: the prequential protocol (1: every event, 0: none).",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "prequential_negatives",
        "Items drawn from those seen before each scored event to rank it against.",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "prequential_window_events",
        "Events per window of the prequential curve (summary, TensorBoard).",
        checks=(POSITIVE,),
    ),
    FlagSpec("sink_size", "Steps per graph call.", checks=(POSITIVE,)),
    FlagSpec("amp_level", "Mixed precision level.", choices=tuple(AMP_LEVELS)),
    FlagSpec("boost_level", "Speed-up level.", choices=tuple(BOOST_LEVELS)),
    *core.at(
        THREAD_FLAGS,
        inter_op_parallelism_threads="inter_op_threads",
        intra_op_parallelism_threads="intra_op_threads",
    ),
    FlagSpec("linger_seconds", "Longest wait for a batch to fill.", checks=(NON_NEGATIVE,)),
    FlagSpec("checkpoint_every_steps", "Checkpoint cadence.", checks=(POSITIVE_OR_UNSET,)),
    FlagSpec("checkpoint_every_secs", "Checkpoint cadence.", checks=(POSITIVE_OR_UNSET,)),
    FlagSpec(
        "full_checkpoint_every",
        "Every how many checkpoints one is full; the others hold only what changed (1: all full).",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "export_every_steps",
        "Version cadence (a whole SavedModel; also once the publications since the last "
        "add up to its size).",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec(
        "export_every_secs",
        "Version cadence (a whole SavedModel; also once the publications since the last "
        "add up to its size).",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec(
        "publish_every_secs",
        "Publish what changed since the last publication this often, beside the versions "
        "in --export_dir, for ncf-serve to apply in place (0: none; servers then load "
        "whole versions).",
        checks=(NON_NEGATIVE,),
    ),
    FlagSpec(
        "publication_channel",
        "Publish to this Kafka topic (of --kafka_servers) or Redis stream (of "
        "--redis_url) instead of --export_dir's publications/ folder, for servers that "
        "read it (ncf-serve --publication_channel); the versions stay in --export_dir.",
    ),
    FlagSpec("log_every_secs", "Metric log cadence.", checks=(POSITIVE,)),
    FlagSpec("max_events", "Stop after this many events.", checks=(POSITIVE_OR_UNSET,)),
    FlagSpec("max_seconds", "Stop after this long.", checks=(POSITIVE_OR_UNSET,)),
    FlagSpec(
        "idle_timeout_secs",
        "Stop once the stream is quiet this long.",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec("trained_events_log", "Append every trained event's id here."),
    FlagSpec("summary_file", "Write the summary and metric history here (JSON)."),
    FlagSpec(
        "profile_steps",
        "FIRST,LAST: profile these steps (from 1, as logged; whole sinks) into "
        "MODEL_DIR/profile for TensorBoard, ops named by the step's stage (id_lookup, "
        "admission, eviction, row_gather, row_update, prequential_scoring).",
        checks=(STEP_RANGE_OR_UNSET,),
    ),
    FlagSpec(
        "serve_as",
        "Run as this task of TF_CONFIG's cluster (a tf.distribute server) instead of "
        "training: ps tasks hold the model, workers run the steps the trainer (the chief, "
        "ncf-online without this flag) schedules.",
        choices=cluster.TASK_TYPES,
    ),
    FlagSpec(
        "cluster_wait_secs",
        "How long the trainer of a TF_CONFIG cluster waits for its ps and worker tasks to "
        "answer before it gives up.",
        checks=(POSITIVE,),
    ),
    Rule(
        ("redis_url", "kafka_servers", "events_dir", "serve_as"),
        lambda values: (
            bool(values["serve_as"])
            or [bool(values[name]) for name in ("redis_url", "kafka_servers", "events_dir")].count(
                True
            )
            == 1
        ),
        "give exactly one source: --redis_url redis://HOST:PORT/DB, --kafka_servers "
        "HOST:PORT or --events_dir DIR",
    ),
    Rule(
        ("evict_filter_value", "user_evict_policy", "item_evict_policy"),
        lambda values: (
            not (
                values["evict_filter_value"]
                and (values["user_evict_policy"] or values["item_evict_policy"])
            )
        ),
        "--evict_filter_value N is both tables' policy ttl:N: give it or "
        "--user_evict_policy/--item_evict_policy, not both",
    ),
    Rule(
        ("publication_channel", "redis_url", "kafka_servers", "export_dir"),
        lambda values: (
            not values["publication_channel"]
            or bool((values["redis_url"] or values["kafka_servers"]) and values["export_dir"])
        ),
        "--publication_channel is a topic or stream of the source's broker: give it with "
        "--kafka_servers or --redis_url, and --export_dir for the versions",
    ),
    Rule(
        ("checkpoint_every_steps", "checkpoint_every_secs"),
        lambda values: bool(values["checkpoint_every_steps"] or values["checkpoint_every_secs"]),
        "set --checkpoint_every_steps or --checkpoint_every_secs",
    ),
)


def define_online_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``online_main`` (Model Garden names where one exists)."""
    core.define_flags(ONLINE_FLAGS, OnlineConfig(), flag_values)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> OnlineConfig:
    """The run the parsed flags describe."""
    config = core.config_from_flags(ONLINE_FLAGS, OnlineConfig(), flag_values)
    # No flag: the online MLP is not regularised, whatever its depth.
    unregularised = (0.0,) * len(config.model.layers)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, mlp_regularization=unregularised)
    )


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    config = config_from_flags(flags.FLAGS)
    with errors.exit_on_user_errors(ValueError, cluster.ClusterError):
        distribution_utils.configure_threads(config.inter_op_threads, config.intra_op_threads)
        if config.serve_as:
            return cluster.serve(config.serve_as)
    start = time.perf_counter()
    # Stop signals are RecModel's: it finishes the step, checkpoints and returns.
    with errors.exit_on_user_errors(
        RedisAccessError, KafkaAccessError, group_claim.GroupClaimError, ValueError, ModelDirError
    ):
        try:
            summary = run(config)
        except cluster.ClusterError as error:
            # At once: tearing down the contexts on the cluster's tasks would only log
            # the dead ones again, after the error line.
            print(f"error: {error}", file=sys.stderr, flush=True)
            os._exit(1)
    logging.info("online training ran %.1f s", time.perf_counter() - start)
    print(run_summary.summary_line(summary))


def run_main() -> None:
    """Console-script entry point (``ncf-online``)."""
    define_online_flags()
    app.run(main, flags_parser=redis_connection.parse_flags)


if __name__ == "__main__":
    run_main()
