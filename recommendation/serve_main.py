"""Serves an online model's export over TensorFlow Serving's REST API (``ncf-serve``).

    ncf-serve --model_name ncf --model_base_path /tmp/ncf-online/export \\
        --rest_api_port 8501

It loads the newest version ncf-online exported to --model_base_path and applies the
trainer's publications to it in place as they appear (`live_model`), so that an event
is in its answers about a second after it was published, whatever the model's size;
it answers ``GET /v1/models/NAME`` and ``POST /v1/models/NAME:predict`` as TensorFlow
Serving does (`rest_api`). The flags are TensorFlow Serving's where they mean the same.
A server started before the first export waits for it and says so. SIGINT/SIGTERM stop
it (the requests in flight are answered). Flags are read here only; `ServeConfig`
carries them inward (docs/serving-online.md).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket

# oneDNN's allocator (TensorFlow's default on x86-64) keeps every buffer freed in a pool
# it never returns: a served table that grows as ids arrive left each of its smaller
# copies there, 7 times its rows' bytes in memory at 3 million ids, 1.8 times with the
# system's allocator. Read when TensorFlow first allocates; a value the user set wins.
os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "1")

from absl import app, flags, logging

from official.core import signals
from official.utils.flags import core
from official.utils.flags.core import NON_NEGATIVE, POSITIVE, FlagSpec, Rule
from official.utils.misc import errors
from recommendation.online.sources import kafka_connection, redis_connection
from recommendation.online.sources.kafka_connection import KafkaAccessError, KafkaOptions
from recommendation.online.sources.redis_connection import RedisAccessError, RedisOptions


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """One server (built from flags by `config_from_flags`); its defaults are the flags'.

    Attributes:
        model_name: The name requests use (``/v1/models/NAME``).
        model_base_path: The export base: ncf-online's --export_dir.
        rest_api_host, rest_api_port: Where to listen (port 0: any free port, logged).
        rest_api_num_threads: Requests answered at once.
        file_system_poll_wait_seconds: How often to look for a new version.
        publication_poll_wait_seconds: How often to look for the next publication.
        max_instances: Most users or pairs one request may hold.
        publication_channel: The trainer's Kafka topic or Redis stream of publications
            (its --publication_channel; None: the folder's ``publications/``).
        redis, kafka: The broker of that channel (its URL or servers, credentials, TLS).
    """

    model_name: str = "default"
    model_base_path: str | None = None
    rest_api_host: str = "0.0.0.0"
    rest_api_port: int = 8501
    rest_api_num_threads: int = 8
    file_system_poll_wait_seconds: float = 1.0
    publication_poll_wait_seconds: float = 0.05
    max_instances: int = 1024
    publication_channel: str | None = None
    redis: RedisOptions = RedisOptions()
    kafka: KafkaOptions = KafkaOptions()


SERVE_FLAGS = (
    FlagSpec("model_name", "Name of the model in request URLs (/v1/models/NAME)."),
    FlagSpec(
        "model_base_path",
        "Folder of the model's versions: ncf-online's --export_dir (local or gs://).",
    ),
    FlagSpec("rest_api_host", "Address to listen on (0.0.0.0: every interface)."),
    FlagSpec(
        "rest_api_port", "Port of the REST API (0: any free one, logged).", checks=(NON_NEGATIVE,)
    ),
    FlagSpec("rest_api_num_threads", "Requests answered at once.", checks=(POSITIVE,)),
    FlagSpec(
        "file_system_poll_wait_seconds",
        "How often to look for a new version in --model_base_path.",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "publication_poll_wait_seconds",
        "How often to look for the trainer's next publication (what changed, applied in place).",
        checks=(POSITIVE,),
    ),
    FlagSpec("max_instances", "Most users or pairs one request may hold.", checks=(POSITIVE,)),
    FlagSpec(
        "publication_channel",
        "Read the trainer's publications from this Kafka topic (of --kafka_servers) or "
        "Redis stream (of --redis_url): its --publication_channel.",
    ),
    *core.under(redis_connection.REDIS_FLAGS, "redis"),
    *core.under(kafka_connection.KAFKA_FLAGS, "kafka"),
    Rule(
        ("publication_channel", "redis_url", "kafka_servers"),
        lambda values: (
            not values["publication_channel"]
            or bool(values["redis_url"]) != bool(values["kafka_servers"])
        ),
        "--publication_channel is a topic or stream: give its broker, --kafka_servers or "
        "--redis_url (one of them)",
    ),
)


def define_serve_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Every flag of ``ncf-serve``."""
    core.define_flags(SERVE_FLAGS, ServeConfig(), flag_values)
    flags.mark_flag_as_required("model_base_path", flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ServeConfig:
    """The server the parsed flags describe."""
    return core.config_from_flags(SERVE_FLAGS, ServeConfig(), flag_values)


class ServeError(Exception):
    """The server cannot start; the message says why and what to do."""


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port`.

    Raises:
        ServeError: It cannot be bound (the port is taken, the address is not here).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # TCP named: asyncio sets TCP_NODELAY on the connections of a TCP socket only, and
    # without it a kept-alive connection waited 40 ms (Nagle's algorithm and a delayed
    # ACK) for every answer after its first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {error.strerror}; stop what listens there or "
            "pass --rest_api_port (0: any free port) or --rest_api_host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: ServeConfig) -> None:
    """Serves until SIGINT/SIGTERM.

    Raises:
        ServeError: It cannot listen where asked.
    """
    import uvicorn  # the serve extra's

    from recommendation.serving import publication_channels, rest_api
    from recommendation.serving.live_model import LiveModel

    channel = publication_channels.make_channel(
        config.model_base_path,
        config.publication_channel,
        redis_connection.resolve(config.redis) if config.redis.url else None,
        kafka_connection.resolve(config.kafka) if config.kafka.servers else None,
    )
    sock = listen(config.rest_api_host, config.rest_api_port)
    host, port = sock.getsockname()[:2]
    live = LiveModel(
        config.model_base_path,
        config.file_system_poll_wait_seconds,
        config.publication_poll_wait_seconds,
        channel,
    )
    api = rest_api.PredictApi(config.model_name, live, config.max_instances)
    application = rest_api.make_app(api, config.rest_api_num_threads)
    logging.info(
        "serving %s over REST on http://%s:%d/v1/models/%s",
        config.model_base_path,
        host,
        port,
        config.model_name,
    )
    server = uvicorn.Server(
        uvicorn.Config(application, log_level="warning", access_log=False, lifespan="on")
    )
    # uvicorn stops on SIGINT/SIGTERM once the requests in flight are answered, then
    # raises the signal again under the handlers it found: these note it, and the
    # server ends as a stopped server does, with status 0.
    stops: list[int] = []
    for signum in signals.STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: stops.append(signum))
    server.run(sockets=[sock])
    if stops:
        logging.info("stopped by %s", signal.Signals(stops[0]).name)


def main(argv: list[str]) -> None:
    del argv  # the flags parser refused any other argument
    config = config_from_flags(flags.FLAGS)
    with errors.exit_on_user_errors(ServeError, RedisAccessError, KafkaAccessError):
        serve(config)


def run_main() -> None:
    """Console-script entry point (``ncf-serve``)."""
    define_serve_flags()
    app.run(main, flags_parser=redis_connection.parse_flags)


if __name__ == "__main__":
    run_main()
