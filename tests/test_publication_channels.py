"""Publications through a broker, for many servers (`serving.publication_channels`):
a server following a Redis stream or a Kafka topic (a real redis-server, a real tansu
broker) holds what the trainer's model holds, from the run's first version or from a
later one (read from the version's copy on), and a publication Redis did not take is
sent again until it is."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tensorflow as tf
from test_serving import _publish, _step

from recommendation.online import online_ncf
from recommendation.online.sources import kafka_connection, redis_connection
from recommendation.online.sources.kafka_connection import KafkaOptions
from recommendation.online.sources.redis_connection import RedisOptions
from recommendation.online.state import serving_export
from recommendation.serving import publication_channels
from recommendation.serving.live_model import LiveModel
from recommendation.serving.online_version import OnlineVersion

pytestmark = pytest.mark.integration


def _holds_the_model(server: LiveModel, network) -> None:
    """`server` holds `network`'s tables row for row, and its dense weights."""
    expected = OnlineVersion(json.loads(json.dumps(network.get_config())))
    expected.copy_from(network)
    for name in ("users", "items"):
        held, wanted = getattr(server.served.module, name), getattr(expected, name)
        size = int(wanted.size.numpy())
        assert int(held.size.numpy()) == size
        np.testing.assert_array_equal(held.keys.numpy()[: size + 1], wanted.keys.numpy())
        np.testing.assert_array_equal(held.rows.numpy()[: size + 1], wanted.rows.numpy())
    for held, wanted in zip(
        server.served.module.dense_variables, expected.dense_variables, strict=True
    ):
        np.testing.assert_array_equal(held.numpy(), wanted.numpy())


def _caught_up(server: LiveModel, run: str, seq: int) -> None:
    """Polls `server` until it holds publication `seq` of `run` (a broker delivers a
    message a moment after it took it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        server.poll()
        if server.served is not None and (server.served.run, server.served.seq) == (run, seq):
            return
        time.sleep(0.05)
    raise AssertionError(f"the server holds {server.status()}, not publication {seq} of {run}")


@pytest.fixture(params=["redis", "kafka"])
def channel_of(request):
    """A function making a new client of one broker's channel ``pubs``, and the broker."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        access = redis_connection.resolve(RedisOptions(url=server.url), environ={})
        yield lambda base: publication_channels.make_channel(base, "pubs", access, None), server
    else:
        broker = request.getfixturevalue("kafka_broker")
        access = kafka_connection.resolve(KafkaOptions(servers=broker.servers), environ={})
        yield lambda base: publication_channels.make_channel(base, "pubs", None, access), broker


def test_a_server_follows_a_brokers_publications_from_any_version(tmp_path, channel_of):
    make, _ = channel_of
    base = str(tmp_path / "export")
    tf.keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(
        online_ncf.OnlineParams(mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0))
    )
    export = serving_export.ExportCallback(
        base, every_steps=10**9, keep=5, publish_every_seconds=10**9, channel=make(base)
    )
    export.set_rec_model(rec_model)
    export.on_train_begin()  # the run's first version
    export.wait()
    first = LiveModel(base, channel=make(base))
    first.poll()  # the first version, then what the channel holds after its copy
    _publish(export, 3, seed=1)
    _caught_up(first, export.run, 3)
    _holds_the_model(first, rec_model.network)
    assert not (tmp_path / "export" / "publications").exists()  # the channel's only
    assert export.act()  # a version holding publication 3's state
    export.wait()
    _publish(export, 2, seed=4)
    later = LiveModel(base, channel=make(base))  # from the newest version, read from its copy
    _caught_up(later, export.run, 5)
    _caught_up(first, export.run, 5)
    _holds_the_model(later, rec_model.network)
    _holds_the_model(first, rec_model.network)
    export.on_train_end()


def test_a_publication_redis_did_not_take_is_sent_again_until_it_is(tmp_path, redis_server):
    access = redis_connection.resolve(RedisOptions(url=redis_server.url), environ={})
    base = str(tmp_path / "export")
    tf.keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(
        online_ncf.OnlineParams(mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0))
    )
    channel = publication_channels.make_channel(base, "pubs", access, None)
    export = serving_export.ExportCallback(
        base, every_steps=10**9, publish_every_seconds=10**9, channel=channel
    )
    export.set_rec_model(rec_model)
    export.on_train_begin()
    export.wait()
    server = LiveModel(base, channel=publication_channels.make_channel(base, "pubs", access, None))
    _publish(export, 1, seed=1)
    _caught_up(server, export.run, 1)
    redis_server.kill()
    _step(rec_model, 2)
    assert export.publisher.publish(2, None)
    assert not export.publisher.wait(1.0)  # sent again and again while Redis is down
    redis_server.start()
    assert export.publisher.wait(60)
    assert channel.outages == 1
    _caught_up(server, export.run, 2)
    _holds_the_model(server, rec_model.network)
    export.on_train_end()
