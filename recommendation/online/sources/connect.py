"""The source a run names, connected: a Redis stream or a Kafka topic (each with its
consumer group claimed unless shared), or else an event folder. The Kafka client is
imported only here, for a Kafka source: it is an extra (``pip install ".[kafka]"``).
"""

from __future__ import annotations

import os
from typing import Any

from absl import logging

from recommendation.online.sources import group_claim, kafka_connection, redis_source
from recommendation.online.sources.dead_letters import DeadLetterFile
from recommendation.online.sources.files import DirectorySource
from recommendation.online.sources.kafka_connection import KafkaAccess, KafkaAccessError
from recommendation.online.sources.redis_connection import RedisAccess


def make_source(
    config: Any,
    redis_access: RedisAccess | None = None,
    kafka_access: KafkaAccess | None = None,
) -> Any:
    """The Redis or Kafka source (answering already) through `redis_access` or
    `kafka_access`, or else the folder source, that `config` (an
    `online_main.OnlineConfig`) names."""
    dead_letter = config.dead_letter_file or os.path.join(config.model_dir, "dead_letters.jsonl")
    if redis_access is not None:
        client = redis_access.client(socket_timeout=30)
        claim = None
        if not config.share_group:
            claim = group_claim.GroupClaim(client, config.stream, config.group, config.model_dir)
        source = redis_source.RedisSource(
            client, config.stream, config.group, config.consumer, claim=claim
        )
        with redis_access.errors_explained(source.acl_rules()):
            client.ping()
            if claim is not None:
                claim.acquire()
        logging.info("reading stream %r of Redis at %s", config.stream, redis_access.shown)
        return source
    if kafka_access is not None:
        return _kafka_source(config, kafka_access, DeadLetterFile(dead_letter))
    return DirectorySource(config.events_dir, DeadLetterFile(dead_letter))


def _kafka_source(config: Any, access: KafkaAccess, dead_letter_file: DeadLetterFile) -> Any:
    """The Kafka source of the config, connected, its group claimed (the client is
    imported here: it is an extra)."""
    kafka_connection.client_module()
    from confluent_kafka import KafkaException

    from recommendation.online.sources import kafka_claim, kafka_messages, kafka_source

    claim = None
    if not config.share_group:
        claim = kafka_claim.KafkaClaim(access, config.kafka_topic, config.group, config.model_dir)
    dead_letters = dead_letter_file
    if config.kafka_dead_letter_topic:
        settings = access.settings(**{"group.id": config.group})
        dead_letters = kafka_messages.DeadLetterTopic(
            settings, config.kafka_dead_letter_topic, config.kafka_topic
        )
    source = kafka_source.KafkaSource(
        access, config.kafka_topic, config.group, dead_letters, claim=claim
    )
    source.connect()
    if claim is not None:
        try:
            claim.acquire()
        except KafkaException as error:
            raise KafkaAccessError(
                access.explain(error.args[0], f"claiming group {config.group!r}")
            ) from None
    return source
