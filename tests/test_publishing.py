"""The trainer's publications (`online.state.publishing`): each holds exactly the rows
written since the one before, the ids that left, and the dense weights; one that
cannot be written is taken again, under its number, with what came after it."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from recommendation.data import constants
from recommendation.online import online_ncf
from recommendation.online.state import publishing
from recommendation.serving import publications
from recommendation.serving.online_version import dense_weights

# Two user rows evicted LRU, no negatives: a step writes the rows of its events only.
PARAMS = online_ncf.OnlineParams(
    mf_dim=2,
    layers=(4, 2),
    mlp_regularization=(0.0, 0.0),
    user_capacity=2,
    item_capacity=8,
    user_eviction="lru",
    num_neg=0,
)
EMPTY = {name: np.zeros(1, np.int64) for name in publications.TABLES}


def _step(rec_model, users, items) -> None:
    batch = {
        constants.USER_COLUMN: np.asarray([users], np.int64),
        constants.ITEM_COLUMN: np.asarray([items], np.int64),
        constants.TIME_COLUMN: np.zeros([1, len(users)], np.int64),
    }
    rec_model.train(1, [batch], dataset_sink_mode=False)


def _rows(table, slots) -> np.ndarray:
    return table.embeddings.numpy()[slots]


def test_a_publication_holds_exactly_the_rows_written_since_the_one_before(tmp_path):
    tf.keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(PARAMS)
    network = rec_model.network
    publisher = publishing.Publisher(str(tmp_path), "r1", network, EMPTY)
    _step(rec_model, [1, 2], [10, 11])  # users 1, 2 in rows 1, 2; items 10, 11 in 1, 2
    assert publisher.publish(1, {"offset": 2})
    publisher.wait()
    _step(rec_model, [2], [10])  # user 2 seen again: user 1 is the least recently seen
    _step(rec_model, [3], [12])  # user 3 takes user 1's row; item 12 row 3
    assert publisher.publish(3, {"offset": 4})
    publisher.close()
    assert publications.numbers(str(tmp_path), "r1") == [1, 2]
    first = publications.read(str(tmp_path), "r1", 1)
    second = publications.read(str(tmp_path), "r1", 2)
    assert (first.seq, first.step, first.position) == (1, 1, {"offset": 2})
    users, items = first.tables["users"], first.tables["items"]
    assert users["slots"].tolist() == [1, 2] and users["keys"].tolist() == [1, 2]
    assert items["slots"].tolist() == [1, 2] and items["keys"].tolist() == [10, 11]
    assert users["deleted"].size == items["deleted"].size == 0
    assert (second.seq, second.step, second.position) == (2, 3, {"offset": 4})
    users, items = second.tables["users"], second.tables["items"]
    assert users["slots"].tolist() == [1, 2] and users["keys"].tolist() == [3, 2]
    assert users["size"] == 2 and users["deleted"].tolist() == [1]
    assert items["slots"].tolist() == [1, 3] and items["keys"].tolist() == [10, 12]
    assert items["size"] == 3 and items["deleted"].size == 0
    # The rows as the trainer holds them now (nothing trained since), the dense weights.
    np.testing.assert_array_equal(users["rows"], _rows(network.user_embedding, [1, 2]))
    np.testing.assert_array_equal(items["rows"], _rows(network.item_embedding, [1, 3]))
    for published, weight in zip(second.dense, dense_weights(network), strict=True):
        np.testing.assert_array_equal(published, weight.numpy())
    assert not publisher.publish(3, {"offset": 4})  # nothing trained since: none


def test_a_publication_that_cannot_be_written_is_taken_again_under_its_number(tmp_path):
    tf.keras.utils.set_random_seed(0)
    rec_model = online_ncf.build_rec_model(PARAMS)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the export folder's parent should be")
    export_base = str(blocker / "exports")
    publisher = publishing.Publisher(export_base, "r1", rec_model.network, EMPTY)
    _step(rec_model, [1], [10])
    assert publisher.publish(1, None)
    publisher.wait()
    assert publisher.failures.count == 1 and publisher.durable_seq == 0
    blocker.unlink()  # fixed
    _step(rec_model, [2], [11])
    assert publisher.flush(2, None)
    publisher.close()
    assert publications.numbers(export_base, "r1") == [1]
    publication = publications.read(export_base, "r1", 1)
    assert publication.tables["users"]["keys"].tolist() == [1, 2]
    assert publication.tables["items"]["keys"].tolist() == [10, 11]
    assert publisher.durable_seq == 1 and publisher.failures.count == 1
