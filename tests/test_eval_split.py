"""--eval_split validation: the three holdouts, the producer's sets, the selection of an
epoch on validation, its restore, the test evaluation once, and resumed runs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    TINY_NCF_MAIN_FLAGS,
    run_module,
    tiny_ncf_config,
    tiny_runner,
    tiny_train_input_fn,
    write_movielens,
)

from official.core.model_dir import ModelDirError
from official.core.runner import completed_epochs_of
from recommendation.data import constants, data_preprocessing, preprocessing_cache
from recommendation.data.data_preprocessing import DataConfig
from recommendation.data.movielens import DataError
from recommendation.producer import (
    data_pipeline,
    negative_sampling,
    run_folder,
    shard_writing,
    stat_utils,
)
from recommendation.producer.run_folder import EvalInfo
from recommendation.serving import neumf_export
from recommendation.training import cycles, reporting, selection

VALIDATION = "validation"  # the --eval_split value


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        yield executor


def _user_items(data, user: int) -> list[int]:
    return data.train_items[data.train_offsets[user] : data.train_offsets[user + 1]].tolist()


def _movielens_rows(seed: int = 3) -> list[tuple[int, int, int]]:
    """Users with 3 to 30 ratings at distinct times, in shuffled file order."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(1, 41):
        count = int(rng.integers(3, 31))
        items = rng.choice(np.arange(1, 200), count, replace=False)
        times = rng.choice(10_000, count, replace=False)
        rows += [(user, int(item), int(time)) for item, time in zip(items, times, strict=True)]
    return [rows[i] for i in rng.permutation(len(rows))]


def test_movielens_holds_out_the_last_for_test_and_the_second_to_last_for_validation(tmp_path):
    rows = _movielens_rows()
    write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), rows, "dat")
    config = DataConfig(dataset="ml-1m", data_dir=str(tmp_path), min_num_ratings=3)
    validated = preprocessing_cache.load_or_build(
        dataclasses.replace(config, eval_split=VALIDATION)
    ).data
    by_time = {}
    for user, item, _ in sorted(rows, key=lambda row: row[2]):
        by_time.setdefault(user, []).append(item)
    for user, raw_user in enumerate(validated.user_ids.tolist()):
        items = validated.item_ids
        train = items[_user_items(validated, user)].tolist()
        validation = int(items[validated.validation_items[user]])
        test = int(items[validated.eval_items[user]])
        # Disjoint, together all of the user's items; test last, validation before it.
        assert train + [validation, test] == by_time[raw_user]
    # The cache is keyed by the split: switching the flag rebuilds it, both ways.
    tested = preprocessing_cache.load_or_build(config)
    assert not tested.from_cache and tested.reason == "parameters changed"
    assert tested.data.validation_items is None
    np.testing.assert_array_equal(tested.data.eval_items, validated.eval_items)
    again = preprocessing_cache.load_or_build(dataclasses.replace(config, eval_split=VALIDATION))
    assert not again.from_cache and again.reason == "parameters changed"


def test_validation_needs_three_ratings_per_user():
    raw = data_preprocessing.RawRatings(
        np.array([1, 1, 1, 2, 2]), np.array([1, 2, 3, 1, 2]), np.array([1, 2, 3, 4, 5])
    )
    with pytest.raises(DataError, match="--eval_split validation needs --min_num_ratings of at"):
        data_preprocessing.preprocess(raw, min_num_ratings=2, eval_split=VALIDATION)
    # Users below the minimum are dropped (and counted in the log).
    data = data_preprocessing.preprocess(raw, min_num_ratings=3, eval_split=VALIDATION)
    assert data.user_ids.tolist() == [1] and _user_items(data, 0) == [0]
    assert (data.validation_items.tolist(), data.eval_items.tolist()) == ([1], [2])


def _write_ncf_split(root, train_lines: str) -> DataConfig:
    folder = root / "ncf"
    folder.mkdir(exist_ok=True)
    (folder / "ml-1m.train.rating").write_text(train_lines)
    (folder / "ml-1m.test.rating").write_text("0\t3\t5\t99\n1\t0\t5\t99\n")
    (folder / "ml-1m.test.negative").write_text("(0,3)\t4\t5\n(1,0)\t5\t4\n")
    return DataConfig(dataset="ncf-ml-1m", data_dir=str(root), eval_split=VALIDATION)


def test_ncf_split_validates_on_the_latest_training_line(tmp_path):
    # User 0: items 0 (t=5), 1 (t=9), 2 (t=9), 5 (t=7): the latest is 2, the last of the
    # two at t=9 in file order; user 1: 4 (t=20) is later than 1, 2 and 3.
    lines = "0\t0\t5\t5\n0\t1\t4\t9\n1\t1\t3\t1\n0\t2\t5\t9\n1\t4\t5\t20\n0\t5\t1\t7\n"
    lines += "1\t2\t4\t3\n1\t3\t4\t2\n"
    data = preprocessing_cache.load_or_build(_write_ncf_split(tmp_path, lines)).data
    assert data.validation_items.tolist() == [2, 4]
    assert (_user_items(data, 0), _user_items(data, 1)) == ([0, 1, 5], [1, 2, 3])
    # The paper's test holdout and its fixed negatives stay as given.
    assert data.eval_items.tolist() == [3, 0]
    np.testing.assert_array_equal(data.eval_negatives, [[4, 5], [5, 4]])
    for user in range(2):  # disjoint, and together every line of the user
        held_out = [int(data.validation_items[user]), int(data.eval_items[user])]
        assert len(set(_user_items(data, user) + held_out)) == len(_user_items(data, user)) + 2


def test_ncf_split_without_times_validates_on_the_last_line(tmp_path):
    lines = "0\t0\t5\n0\t2\t5\n0\t5\t5\n0\t1\t4\n1\t1\t3\n1\t4\t5\n1\t2\t4\n"
    data = preprocessing_cache.load_or_build(_write_ncf_split(tmp_path, lines)).data
    assert data.validation_items.tolist() == [1, 2]
    assert (_user_items(data, 0), _user_items(data, 1)) == ([0, 2, 5], [1, 4])


def test_ncf_split_user_with_one_training_line_is_an_error(tmp_path):
    config = _write_ncf_split(tmp_path, "0\t0\t5\t1\n0\t5\t5\t2\n1\t1\t5\t1\n")
    with pytest.raises(DataError, match="user 1 has 1 training item.*--eval_split test"):
        preprocessing_cache.load_or_build(config)


@pytest.mark.parametrize("kind", ["movielens", "ncf"])
def test_training_and_validation_sets_keep_out_what_they_must(kind, tmp_path, pool):
    if kind == "movielens":
        write_movielens(str(tmp_path / "ml-1m" / "ratings.dat"), _movielens_rows(5), "dat")
        config = DataConfig(
            dataset="ml-1m", data_dir=str(tmp_path), min_num_ratings=3, eval_split=VALIDATION
        )
    else:
        rng = np.random.default_rng(2)
        lines = "".join(
            f"{user}\t{item}\t5\t{rng.integers(100)}\n"
            for user in range(2)
            for item in (6, 7, 8, 9, 10, 11)
        )
        config = _write_ncf_split(tmp_path, lines)
    data = preprocessing_cache.load_or_build(config).data
    every_item = [
        set(_user_items(data, user))
        | {int(data.validation_items[user]), int(data.eval_items[user])}
        for user in range(data.num_users)
    ]
    exclusion = stat_utils.ExclusionIndex.from_csr(
        data.train_offsets, data.train_items, data.num_items
    )
    for epoch_index in range(2):
        epoch = negative_sampling.training_epoch(data, exclusion, 4, 7, epoch_index, pool)
        users, items = epoch.users[epoch.labels], epoch.items[epoch.labels]
        assert not np.any(items == data.validation_items[users])
        assert not np.any(items == data.eval_items[users])
    num_negatives = 7 if kind == "movielens" else 2  # the paper's: the test block's count
    blocks = negative_sampling.eval_blocks(data, num_negatives, 7, pool, VALIDATION)
    assert blocks.block_size == num_negatives + 1
    np.testing.assert_array_equal(blocks.items[:, -1], data.validation_items)
    for user in range(data.num_users):
        assert not set(blocks.items[user, :-1].tolist()) & every_item[user]
    test = negative_sampling.eval_blocks(data, num_negatives, 7, pool)
    np.testing.assert_array_equal(test.items[:, -1], data.eval_items)
    if kind == "ncf":
        np.testing.assert_array_equal(test.items[:, :-1], data.eval_negatives)
    else:
        for user in range(data.num_users):
            assert not set(test.items[user, :-1].tolist()) & every_item[user]


def test_a_pruned_checkpoint_kept_as_the_best_is_restored(tmp_path):
    runner = tiny_runner(str(tmp_path), keep_checkpoints=1)
    runner.train(tiny_train_input_fn, 2)
    first = runner.save_checkpoint()
    runner.save_best()
    kept = [weight.numpy() for weight in runner.state.model.weights]
    runner.train(tiny_train_input_fn, 2)
    runner.save_checkpoint()
    assert not tf.io.gfile.exists(first + ".index")  # pruned by the per-cycle manager
    runner.restore_best()
    for weight, value in zip(runner.state.model.weights, kept, strict=True):
        np.testing.assert_array_equal(weight.numpy(), value)


# ---------------------------------------------------------------------------
# End to end. A wide model at a high learning rate overfits the tiny data: validation
# HR peaks at epoch 1 of 0..3 (0.46, 0.67, 0.58, 0.51), so the selected epoch is not the
# last.


def _config(root, **overrides):
    config = tiny_ncf_config(root, benchmark_log_dir=str(root / "bench"), train_epochs=4)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, eval_split=VALIDATION),
        model=dataclasses.replace(config.model, mf_dim=64, layers=(128, 64), learning_rate=0.03),
    )
    return dataclasses.replace(config, **overrides)


def _validation_records(root) -> list[dict]:
    with open(root / "bench" / "benchmark.jsonl") as log:
        records = [json.loads(line) for line in log]
    return [r for r in records if r["kind"] == "evaluation" and r["split"] == VALIDATION]


def _selected(summary: dict) -> tuple:
    return tuple(
        summary[key] for key in ("best_epoch", "best_hr", "best_ndcg", "test_hr", "test_ndcg")
    )


@pytest.fixture(scope="module")
def selected_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("selected")
    config = _config(root, export_dir=str(root / "export"))
    return root, config, cycles.run(config)


def _test_metrics(runner, config, pool, root) -> dict:
    """The test HR/NDCG of `runner`'s weights, recomputed: the test blocks built here (the
    producer's functions and seed), written as the producer writes them, evaluated."""
    data = preprocessing_cache.load_or_build(config.data).data
    blocks = negative_sampling.eval_blocks(data, 99, config.seed, pool)
    users = cycles._eval_users_per_batch(config, blocks.block_size, 1, data.num_users)
    info = EvalInfo(
        folder=str(root / "recomputed"),
        num_batches=-(-data.num_users // users),
        users_per_batch=users,
        block_size=blocks.block_size,
        num_users=data.num_users,
        num_shards=1,
    )
    writers = shard_writing.open_writers(info.folder, 1)
    shard_writing.write_shards(
        writers,
        lambda batch: shard_writing.eval_batch(blocks, batch, users),
        run_folder.eval_record(users, blocks.block_size),
        info.num_batches,
        pool,
    )
    shard_writing.close_writers(writers)
    return runner.evaluate(lambda: data_pipeline.eval_input_fn(info), info.num_batches)


def test_the_best_validation_epoch_is_restored_and_tested_once(selected_run, pool, tmp_path):
    root, config, result = selected_run
    summary, runner = result.summary, result.runner
    records = _validation_records(root)
    hrs = [record["hr"] for record in records]
    assert [record["epoch"] for record in records] == [0, 1, 2, 3]
    selected = hrs.index(max(hrs))  # the earliest of the best
    assert summary["best_epoch"] == selected != 3, hrs
    assert (summary["best_hr"], summary["best_ndcg"]) == (hrs[selected], records[selected]["ndcg"])
    assert summary["eval_split"] == VALIDATION
    assert _selected(summary) == tuple(_selected(_summary_record(root)))
    # The model is the selected epoch's checkpoint (still kept: the last 3), not the last.
    steps = runner.params.steps_per_epoch
    epoch_checkpoint = os.path.join(config.model_dir, f"ckpt-{(selected + 1) * steps}")
    best = tf.train.latest_checkpoint(os.path.join(config.model_dir, "best"))
    assert completed_epochs_of(best) == selected + 1
    data = preprocessing_cache.load_or_build(config.data).data
    last = cycles._make_runner(config, data, runner.strategy)  # the latest checkpoint
    chosen = cycles._make_runner(config, data, runner.strategy)
    state = chosen.state
    tf.train.Checkpoint(model=state.model, optimizer=state.optimizer).restore(
        epoch_checkpoint
    ).expect_partial()
    weights = [[w.numpy() for w in r.state.model.weights] for r in (runner, chosen, last)]
    for restored, of_epoch in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(restored, of_epoch)
    assert any(not np.array_equal(a, b) for a, b in zip(weights[1], weights[2], strict=True))
    # Its test metrics, recomputed from the restored weights: the reported ones exactly.
    recomputed = _test_metrics(runner, config, pool, tmp_path)
    assert (recomputed["hr"], recomputed["ndcg"]) == (summary["test_hr"], summary["test_ndcg"])
    assert reporting.summary_line(summary, 10).startswith(
        f"selected epoch {selected}: validation HR@10={summary['best_hr']:.4f} NDCG@10="
        f"{summary['best_ndcg']:.4f}; test HR@10={summary['test_hr']:.4f} NDCG@10="
    )


def _summary_record(root) -> dict:
    with open(root / "bench" / "benchmark.jsonl") as log:
        return [r for r in map(json.loads, log) if r["kind"] == "summary"][-1]


def test_the_export_holds_the_selected_weights(selected_run):
    root, config, result = selected_run
    data = preprocessing_cache.load_or_build(config.data).data
    serving = tf.saved_model.load(config.export_dir).signatures["serving_default"]
    users = np.arange(data.num_users)
    items = users % data.num_items
    exported = serving(
        user_id=tf.constant(data.user_ids[users]), item_id=tf.constant(data.item_ids[items])
    )["scores"].numpy()
    features = {
        constants.USER_COLUMN: tf.constant(users, tf.int32),
        constants.ITEM_COLUMN: tf.constant(items, tf.int32),
    }
    in_memory = tf.sigmoid(result.runner.state.model(features)[:, 0]).numpy()
    np.testing.assert_allclose(exported, in_memory, atol=1e-6)
    # And the export command, from the checkpoints, exports the same selected weights.
    again = dataclasses.replace(config, export_dir=str(root / "again"))
    neumf_export.export_from_checkpoint(again)
    from_checkpoint = tf.saved_model.load(again.export_dir).signatures["serving_default"]
    scores = from_checkpoint(
        user_id=tf.constant(data.user_ids[users]), item_id=tf.constant(data.item_ids[items])
    )["scores"].numpy()
    np.testing.assert_array_equal(scores, exported)


def test_the_same_seed_selects_the_same_epoch_with_the_same_metrics(selected_run, tmp_path):
    _, _, result = selected_run
    again = cycles.run(_config(tmp_path)).summary
    assert _selected(again) == _selected(result.summary)


def test_a_resumed_run_selects_over_the_epochs_before_the_restart(selected_run, tmp_path):
    _, _, uninterrupted = selected_run
    cycles.run(_config(tmp_path, train_epochs=3))
    resumed = cycles.run(_config(tmp_path)).summary
    records = _validation_records(tmp_path)  # both runs' evaluations
    hrs = [record["hr"] for record in records]
    assert [record["epoch"] for record in records] == [0, 1, 2, 3]
    # The resumed run evaluated epoch 3 only; the best came before the restart.
    assert resumed["best_epoch"] == hrs.index(max(hrs)) < 3
    assert _selected(resumed) == _selected(uninterrupted.summary)
    # Stopped between a checkpoint and the history: the restored epoch is evaluated again.
    history_path = tmp_path / "model" / selection.VALIDATION_HISTORY_FILE
    history = json.loads(history_path.read_text())
    history["epochs"] = history["epochs"][:-1]
    history_path.write_text(json.dumps(history))
    finished = cycles.run(_config(tmp_path)).summary
    assert finished["resumed_finished_run"] and _selected(finished) == _selected(resumed)
    assert [e["epoch"] for e in json.loads(history_path.read_text())["epochs"]] == [0, 1, 2, 3]
    assert "selected on validation" in reporting.summary_line(finished, 10)


def test_a_model_dir_of_the_other_split_is_refused(tmp_path):
    tested = _config(tmp_path / "tested", train_epochs=1)
    cycles.run(
        dataclasses.replace(tested, data=dataclasses.replace(tested.data, eval_split="test"))
    )
    with pytest.raises(ModelDirError, match="holds a run of --eval_split test"):
        cycles.run(tested)
    validated = _config(tmp_path / "validated", train_epochs=1)
    cycles.run(validated)
    as_test = dataclasses.replace(
        validated, data=dataclasses.replace(validated.data, eval_split="test")
    )
    with pytest.raises(ModelDirError, match="holds a run of --eval_split validation"):
        cycles.run(as_test)


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--eval_split=train"],
            "error: flag --eval_split=train: value should be one of <test|validation> "
            "(--helpshort lists the flags)",
        ),
        (
            ["--eval_split=validation", "--output_ml_perf_compliance_logging"],
            "error: --output_ml_perf_compliance_logging records the MLPerf protocol, which "
            "evaluates every cycle on the test holdout: drop --eval_split validation for a "
            "compliance run",
        ),
    ],
)
def test_bad_eval_split_flags(tmp_path, extra, message):
    result = run_module(
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path}",
        f"--model_dir={tmp_path / 'model'}",
        *extra,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message in result.stderr
    if message.startswith("error: "):
        assert result.stderr.splitlines()[-1] == message
