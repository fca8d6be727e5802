"""What an online version holds and serves (`serving.online_version`), and the
publications that keep one up to date: a version plus the publications after it is
the trainer's model, under churn, row for row."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import tensorflow as tf

from recommendation.data import constants
from recommendation.online import online_ncf
from recommendation.online.state import publishing, serving_export
from recommendation.serving import publications
from recommendation.serving.online_version import OnlineVersion

PARAMS = online_ncf.OnlineParams(
    mf_dim=4, layers=(8, 4), mlp_regularization=(0.0, 0.0), user_capacity=64, item_capacity=32
)


def _batch(users, items) -> dict:
    return {
        constants.USER_COLUMN: np.asarray(users, np.int64)[None],
        constants.ITEM_COLUMN: np.asarray(items, np.int64)[None],
        constants.TIME_COLUMN: np.zeros([1, len(users)], np.int64),
    }


def _trained(params=PARAMS, steps: int = 1, seed: int = 0):
    tf.keras.utils.set_random_seed(seed)
    rec_model = online_ncf.build_rec_model(params)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rec_model.train(
            1, [_batch(rng.integers(1, 101, 40), rng.integers(0, 30, 40))], dataset_sink_mode=False
        )
    return rec_model


def _version_of(network) -> OnlineVersion:
    version = OnlineVersion(json.loads(json.dumps(network.get_config())))
    version.copy_from(network)
    version.reindex()
    return version


def test_a_version_holds_the_index_and_live_rows_only_and_scores_as_the_trainer(tmp_path):
    """What a server loads: each table's ids, live rows and index (not its moments or
    eviction state, nor rows allocated ahead), scoring as the trained model does; an
    id without a row scores with the default row and is not known."""
    rec_model = _trained(dataclasses.replace(PARAMS, user_capacity=2**40))
    network = rec_model.network
    version = _version_of(network)
    tf.saved_model.save(version, str(tmp_path / "export"), signatures=version.signatures())
    variables = dict(tf.train.list_variables(str(tmp_path / "export" / "variables" / "variables")))
    assert not [n for n in variables if re.search("momentum|accumulator|priority|last_seen", n)]
    users = int(network.user_embedding.size.numpy())
    assert sorted(shape[0] for name, shape in variables.items() if "rows" in name) == [
        int(network.item_embedding.size.numpy()) + 1,
        users + 1,
    ]
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    known_users = network.user_embedding.contents()[0].numpy()[:2]
    user_ids = tf.constant([*known_users, 10**6], tf.int64)
    item_ids = tf.constant(network.item_embedding.contents()[0].numpy()[:3], tf.int64)
    expected = tf.sigmoid(
        network.score_rows(network.user_embedding(user_ids), network.item_embedding(item_ids))
    )
    answer = served(user_id=user_ids, item_id=item_ids)
    np.testing.assert_allclose(answer["scores"], expected, rtol=1e-6)
    np.testing.assert_array_equal(answer["known"], [True, True, False])


def test_recommend_ranks_every_item_in_the_table_as_serving_default_scores_it():
    """Top-k of every item holding a row, best first, by raw id; an unknown user -1 /
    NaN; k above the catalogue cut to it; k per user padded past its own."""
    network = _trained(steps=3).network
    version = _version_of(network)
    items = np.sort(network.item_embedding.contents()[0].numpy())
    users = np.array([*network.user_embedding.contents()[0].numpy()[:2], 999_999], np.int64)
    top = version.recommend(tf.constant(users), tf.constant(4))
    np.testing.assert_array_equal(top["known"], [True, True, False])
    for row, user in enumerate(users[:2]):
        scores = version.serve(tf.constant([user] * len(items), tf.int64), tf.constant(items))[
            "scores"
        ]
        order = np.argsort(-scores.numpy(), kind="stable")[:4]
        np.testing.assert_array_equal(top["item_ids"][row], items[order])
        np.testing.assert_allclose(top["scores"][row], scores.numpy()[order], rtol=1e-6)
    np.testing.assert_array_equal(top["item_ids"][2], [-1] * 4)
    assert np.isnan(top["scores"][2]).all()
    everything = version.recommend(tf.constant(users[:1]), tf.constant(10**6))
    assert everything["item_ids"].shape == (1, len(items))
    assert sorted(everything["item_ids"][0].numpy()) == sorted(items)
    each = version.recommend(tf.constant(users[:2]), tf.constant([1, 3]))
    np.testing.assert_array_equal(each["item_ids"][0, 1:], [-1, -1])
    np.testing.assert_array_equal(each["item_ids"][1], top["item_ids"][1, :3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be at least 1"):
        version.recommend(tf.constant(users[:1]), tf.constant(0))


def test_applying_a_publication_reads_no_served_table_whole():
    """A publication's rows are scattered into the served tables, whose length is asked
    of their shape: a dense read would copy a table whole at every publication."""
    version = _version_of(_trained(PARAMS).network)
    graph = version._apply.get_concrete_function().graph
    inner = {id(outer): placeholder for outer, placeholder in graph.captures}
    read_whole = [
        f"{name}.{part}"
        for name in publications.TABLES
        for part in ("keys", "rows")
        for op in inner[id(getattr(getattr(version, name), part).handle)].consumers()
        if op.type == "ReadVariableOp"
    ]
    assert read_whole == []


@pytest.mark.parametrize("every", [1, 3])
def test_a_version_and_the_publications_after_it_are_the_trainers_model(tmp_path, every):
    """Users expire after 2 steps (rows freed, the last rows moved into the holes, the
    table shrinking and growing), items are evicted LRU from a full table: a version
    copied at the start and given each publication read back from its file holds what
    a version copied at the end holds, row for row, and finds every id where it is."""
    params = dataclasses.replace(
        PARAMS, user_capacity=40, item_capacity=12, user_eviction="ttl:2", item_eviction="lru"
    )
    tf.keras.utils.set_random_seed(3)
    rec_model = online_ncf.build_rec_model(params)
    network = rec_model.network
    rng = np.random.default_rng(3)
    rec_model.train(1, [_batch([1, 2, 3], [1, 2, 3])], dataset_sink_mode=False)
    served = _version_of(network)
    keys = {name: getattr(served, name).keys.numpy() for name in publications.TABLES}
    publisher = publishing.Publisher(str(tmp_path), "run", network, keys)
    seen = {name: set() for name in publications.TABLES}
    for step in range(24):
        users, items = rng.integers(1, 60, 20), rng.integers(1, 40, 20)
        seen["users"].update(users.tolist())
        seen["items"].update(items.tolist())
        rec_model.train(1, [_batch(users, items)], dataset_sink_mode=False)
        if step % every == every - 1:
            assert publisher.publish(step, {"step": step})
            publisher.wait()
    publisher.close()

    def held(version) -> dict[str, set]:
        return {
            name: set(getattr(version, name).live()[0].numpy().tolist())
            for name in publications.TABLES
        }

    for seq in publications.numbers(str(tmp_path), "run"):
        publication = publications.read(str(tmp_path), "run", seq)
        before = held(served)
        served.apply(publication.tables, publication.dense)
        after = held(served)
        for name in publications.TABLES:  # what left the table, and only that
            assert set(publication.tables[name]["deleted"].tolist()) == before[name] - after[name]
    assert network.user_embedding.counts()["evicted"] > 20  # the churn happened
    assert network.item_embedding.counts()["evicted"] > 20
    fresh = _version_of(network)
    for name in publications.TABLES:
        mine, theirs = getattr(served, name), getattr(fresh, name)
        size = int(theirs.size.numpy())
        assert int(mine.size.numpy()) == size
        np.testing.assert_array_equal(mine.keys.numpy()[1 : size + 1], theirs.keys.numpy()[1:])
        np.testing.assert_array_equal(mine.rows.numpy()[1 : size + 1], theirs.rows.numpy()[1:])
        ids = tf.constant(sorted(seen[name]), tf.int64)
        np.testing.assert_array_equal(mine.slots(ids), theirs.slots(ids))
    for mine, theirs in zip(served.dense_variables, fresh.dense_variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    users = tf.constant(sorted(seen["users"]), tf.int64)
    np.testing.assert_array_equal(
        served.recommend(users, tf.constant(5))["item_ids"],
        fresh.recommend(users, tf.constant(5))["item_ids"],
    )


def test_versions_after_the_first_are_the_publications_applied_not_a_copy_of_the_tables(
    tmp_path, monkeypatch
):
    """Where the trainer publishes, only the run's first version is copied from its
    tables (a copy of a 10^7-row table stalled training for seconds); a later version
    is the first with every publication applied on the export thread, and its files
    hold what a copy of the model would, row for row and no row more, under churn."""
    copies = []
    copy_from = OnlineVersion.copy_from
    monkeypatch.setattr(
        OnlineVersion, "copy_from", lambda self, network: copies.append(copy_from(self, network))
    )
    params = dataclasses.replace(
        PARAMS, user_capacity=40, item_capacity=12, user_eviction="ttl:2", item_eviction="lru"
    )
    tf.keras.utils.set_random_seed(5)
    rec_model = online_ncf.build_rec_model(params)
    network = rec_model.network
    export = serving_export.ExportCallback(
        str(tmp_path), every_steps=10**9, keep=5, publish_every_seconds=10**9
    )
    export.set_rec_model(rec_model)
    rec_model.train(1, [_batch([1, 2, 3], [1, 2, 3])], dataset_sink_mode=False)
    export.on_train_begin()  # the run's first version
    rng = np.random.default_rng(5)
    for step in range(2, 20):
        rec_model.train(
            1, [_batch(rng.integers(1, 60, 20), rng.integers(1, 40, 20))], dataset_sink_mode=False
        )
        if step % 3 == 0:
            assert export.publisher.publish(step, {"step": step})
        if step % 8 == 0:
            assert export.act()  # the publication of what is pending first
    export.on_train_end()
    assert len(copies) == 1 and len(export.exported) == 4
    assert network.user_embedding.counts()["evicted"] > 10  # the churn happened
    written = OnlineVersion(json.loads(json.dumps(network.get_config())))
    tf.train.Checkpoint(root=written).read(
        f"{export.exported[-1]}/variables/variables"
    ).assert_existing_objects_matched()
    fresh = _version_of(network)
    for name in publications.TABLES:
        for part in ("keys", "rows", "size"):
            np.testing.assert_array_equal(
                getattr(getattr(written, name), part).numpy(),
                getattr(getattr(fresh, name), part).numpy(),
            )
    for mine, theirs in zip(written.dense_variables, fresh.dense_variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
