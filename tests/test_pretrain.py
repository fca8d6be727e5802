"""The NCF paper's GMF and MLP models (--model) and NeuMF pre-trained from them
(--pretrain_gmf_dir, --pretrain_mlp_dir, --pretrain_alpha), fine-tuned with --optimizer sgd."""

from __future__ import annotations

import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import TINY_NCF_MAIN_FLAGS, TINY_PARAMS, run_module, tiny_ncf_config

from official.core import distribution_utils
from official.core.model_dir import ModelDirError
from official.core.runner import Runner
from recommendation.data import constants, preprocessing_cache
from recommendation.model import network, neumf_model, optimizers
from recommendation.producer import data_pipeline
from recommendation.training import cycles, pretrain, selection

GMF, MLP, NEUMF, MF = "gmf", "mlp", "neumf", "mf"  # --model

USERS, ITEMS = TINY_PARAMS.num_users, TINY_PARAMS.num_items
# Every (user, item) pair, user-major.
PAIR_USERS = np.repeat(np.arange(USERS), ITEMS).astype(np.int32)
PAIR_ITEMS = np.tile(np.arange(ITEMS), USERS).astype(np.int32)


def _gmf_logits(weights: list[np.ndarray], users, items) -> np.ndarray:
    """w . (p_u * q_i) + b."""
    p, q, w, b = weights
    return (p[users] * q[items]) @ w[:, 0] + b[0]


def _mlp_logits(weights: list[np.ndarray], users, items) -> np.ndarray:
    """The tower: relu(... relu([p_u; q_i] W_1 + b_1) ...) w + b."""
    p, q, *layers, w, b = weights
    x = np.concatenate([p[users], q[items]], axis=1)
    for kernel, bias in zip(layers[::2], layers[1::2], strict=True):
        x = np.maximum(x @ kernel + bias, 0.0)
    return x @ w[:, 0] + b[0]


def _model(kind: str, **sizes) -> network.NeuMF:
    """A model of `kind` with random weights (biases too), in float64-friendly numpy."""
    model = network.build_model(dataclasses.replace(TINY_PARAMS, model_kind=kind, **sizes))
    rng = np.random.default_rng(4)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(np.float32) for w in model.weights])
    return model


def _weights(model) -> list[np.ndarray]:
    return [w.numpy().astype(np.float64) for w in model.weights]


def _every_scoring_path(model: network.NeuMF) -> dict[str, np.ndarray]:
    """The logits of every pair (user-major) by each way the model scores: `call` on
    small batches and on one batch larger than the tables (the projected first layer),
    `score_all_items`, and `score_blocks` by table and by lookup."""
    pairs = {constants.USER_COLUMN: PAIR_USERS, constants.ITEM_COLUMN: PAIR_ITEMS}
    small = [
        model({key: value[start : start + 16] for key, value in pairs.items()})[:, 0]
        for start in range(0, USERS * ITEMS, 16)
    ]
    users = np.arange(USERS, dtype=np.int32)
    grid = np.tile(np.arange(ITEMS, dtype=np.int32), (USERS, 1))
    half = ITEMS // 2
    lookup = [  # blocks of fewer points than items: gathered per block
        model.score_blocks(users[u : u + 1], grid[u : u + 1, part])[0]
        for u in range(USERS)
        for part in (slice(0, half), slice(half, ITEMS))
    ]
    return {
        "call": np.concatenate(small),
        "call_projected": model(pairs)[:, 0].numpy(),
        "score_all_items": model.score_all_items(users).numpy().reshape(-1),
        "score_blocks": model.score_blocks(users, grid).numpy().reshape(-1),
        "score_blocks_lookup": np.concatenate(lookup),
    }


def _assert_every_path_gives(model, expected: np.ndarray) -> None:
    for path, logits in _every_scoring_path(model).items():
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5, err_msg=path)


def test_a_gmf_model_scores_w_dot_the_product_of_its_embeddings_plus_b():
    model = _model(GMF)
    assert [tuple(w.shape) for w in model.weights] == [(USERS, 8), (ITEMS, 8), (8, 1), (1,)]
    _assert_every_path_gives(model, _gmf_logits(_weights(model), PAIR_USERS, PAIR_ITEMS))


def test_an_mf_model_is_a_dot_product_plus_b_whose_weights_stay_at_one(tmp_path):
    """An MF model is a GMF model with its logit weights fixed at 1: the same weights in
    the same places (so its checkpoint pretrains NeuMF's GMF part), training moves the
    tables and the bias and never the weights."""
    model = _source_run(tmp_path, MF).state.model  # trained 3 Adam steps
    assert [tuple(w.shape) for w in model.weights] == [(USERS, 8), (ITEMS, 8), (8, 1), (1,)]
    assert [v.path for v in model.trainable_variables] == [
        v.path for i, v in enumerate(model.weights) if i != 2
    ]
    p, q, w, b = _weights(model)
    np.testing.assert_array_equal(w, np.ones((8, 1)))
    assert b[0] != 0.0  # trained from zero
    _assert_every_path_gives(model, (p[PAIR_USERS] * q[PAIR_ITEMS]).sum(axis=1) + b[0])


@pytest.mark.parametrize("layers", [(8, 4), (8, 6, 4), (8,)])
def test_an_mlp_model_scores_its_tower(layers):
    model = _model(MLP, layers=layers, mlp_regularization=(0.0,) * len(layers))
    assert model.weights[0].shape == (USERS, 4)  # layers[0] / 2 per side, no GMF part
    _assert_every_path_gives(model, _mlp_logits(_weights(model), PAIR_USERS, PAIR_ITEMS))


@pytest.mark.parametrize("kind", [GMF, MLP, NEUMF, MF])
def test_each_kind_survives_its_config(kind):
    model = _model(kind)
    restored = network.NeuMF.from_config(model.get_config())
    restored(
        {
            constants.USER_COLUMN: tf.zeros([1], tf.int32),
            constants.ITEM_COLUMN: tf.zeros([1], tf.int32),
        }
    )
    restored.set_weights(model.get_weights())
    assert restored.model_kind == kind
    np.testing.assert_array_equal(
        restored.score_all_items(tf.range(USERS)), model.score_all_items(tf.range(USERS))
    )


def test_sgd_moves_only_by_the_learning_rate_times_the_gradient():
    params = dataclasses.replace(TINY_PARAMS, optimizer="sgd", learning_rate=0.5)
    optimizer = optimizers.build_optimizer(params)
    assert isinstance(optimizer, keras.optimizers.SGD)
    variable = tf.Variable([1.0, 2.0])
    optimizer.apply([tf.constant([0.2, -0.4])], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.9, 2.2])


# ---------------------------------------------------------------------------
# Pre-training from checkpoints


def _source_run(root, kind: str, best: bool = False, **sizes) -> Runner:
    """A `kind` model trained a few steps in model_dir ``root/kind`` and checkpointed;
    with `best` kept as a validation run keeps its selected epoch (`save_best` and a
    validation history), then trained on and checkpointed again."""
    tf.keras.utils.set_random_seed(5)
    params = dataclasses.replace(TINY_PARAMS, model_kind=kind, learning_rate=0.05, **sizes)
    runner = Runner(
        neumf_model.model_fn,
        neumf_model.build_state,
        params,
        str(root / kind),
        tf.distribute.OneDeviceStrategy("/cpu:0"),
    )
    input_fn = lambda: data_pipeline.synthetic_train_input_fn(32, USERS, ITEMS, seed=3)  # noqa: E731
    runner.train(input_fn, 3)
    runner.save_checkpoint()
    if best:
        runner.save_best()
        (root / kind / selection.VALIDATION_HISTORY_FILE).write_text("{}")
        kept = _weights(runner.state.model)
        runner.train(input_fn, 3)
        runner.save_checkpoint()  # the latest now differs from the kept best
        runner.state.model.set_weights(kept)
    return runner


def _neumf(
    root, alpha: float = 0.5, eval_split: str = "test", gmf: str = GMF, mlp: str = MLP
) -> Runner:
    """A fresh NeuMF runner of `TINY_PARAMS`, started from ``root/gmf`` and ``root/mlp``."""
    config = tiny_ncf_config(
        root,
        model_dir=str(root / "neumf"),
        pretrain_gmf_dir=str(root / gmf),
        pretrain_mlp_dir=str(root / mlp),
        pretrain_alpha=alpha,
    )
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_split=eval_split)
    )
    runner = Runner(
        neumf_model.model_fn,
        neumf_model.build_state,
        TINY_PARAMS,
        config.model_dir,
        tf.distribute.OneDeviceStrategy("/cpu:0"),
    )
    pretrain.start_from_pretrained(config, runner)
    return runner


@pytest.mark.parametrize("split, gmf_kind", [("test", GMF), ("validation", GMF), ("test", MF)])
def test_pretrained_neumf_starts_as_alpha_gmf_plus_one_minus_alpha_mlp(tmp_path, split, gmf_kind):
    validation = split == "validation"
    gmf = _weights(_source_run(tmp_path, gmf_kind, best=validation).state.model)
    mlp = _weights(_source_run(tmp_path, MLP, best=validation).state.model)
    alpha = 0.3
    neumf = _neumf(tmp_path, alpha, split, gmf=gmf_kind).state.model
    expected = alpha * _gmf_logits(gmf, PAIR_USERS, PAIR_ITEMS) + (1 - alpha) * _mlp_logits(
        mlp, PAIR_USERS, PAIR_ITEMS
    )
    _assert_every_path_gives(neumf, expected)
    # The rule itself: tables side by side, the MLP's layers, the logit layers weighed.
    ours = _weights(neumf)
    np.testing.assert_array_equal(ours[0], np.concatenate([gmf[0], mlp[0]], axis=1))
    np.testing.assert_array_equal(ours[1], np.concatenate([gmf[1], mlp[1]], axis=1))
    for theirs, mine in zip(mlp[2:-2], ours[2:-2], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_allclose(ours[-2], np.concatenate([alpha * gmf[-2], (1 - alpha) * mlp[-2]]))
    np.testing.assert_allclose(ours[-1], alpha * gmf[-1] + (1 - alpha) * mlp[-1], rtol=1e-6)


@pytest.mark.parametrize(
    "gmf_sizes, mlp_sizes, swap, message",
    [
        (
            dict(mf_dim=6),
            {},
            False,
            "--pretrain_gmf_dir {root}/gmf holds a GMF model of --num_factors 6, this run "
            "has --num_factors 8: pretrain with the same --num_factors",
        ),
        (
            {},
            dict(layers=(8, 2), mlp_regularization=(0.0, 0.0)),
            False,
            "--pretrain_mlp_dir {root}/mlp holds an MLP model of --layers 8,2, this run has "
            "--layers 16,8: pretrain with the same --layers",
        ),
        (
            dict(num_users=USERS + 1),
            {},
            False,
            f"--pretrain_gmf_dir {{root}}/gmf holds a model of {USERS + 1} users and {ITEMS} "
            f"items, this run's data has {USERS} and {ITEMS}: pretrain on the same --dataset",
        ),
        (
            {},
            {},
            True,
            "--pretrain_gmf_dir {root}/mlp holds an MLP model ({root}/mlp/ckpt-3), not a GMF "
            "one: give the model_dir of an ncf-main --model gmf or mf run",
        ),
    ],
)
def test_a_pretrained_model_of_other_sizes_or_kind_is_refused(
    tmp_path, gmf_sizes, mlp_sizes, swap, message
):
    _source_run(tmp_path, GMF, **gmf_sizes)
    _source_run(tmp_path, MLP, **mlp_sizes)
    with pytest.raises(ModelDirError) as raised:
        _neumf(tmp_path, gmf=MLP if swap else GMF)
    assert str(raised.value).startswith(message.format(root=tmp_path))


def test_a_pretrain_dir_without_a_checkpoint_or_of_the_other_split_is_refused(tmp_path):
    with pytest.raises(ModelDirError, match="--pretrain_gmf_dir .*/gmf holds no checkpoint: train"):
        _neumf(tmp_path)
    _source_run(tmp_path, GMF)
    _source_run(tmp_path, MLP)
    with pytest.raises(ModelDirError, match="holds a run of --eval_split test, which trained"):
        _neumf(tmp_path, eval_split="validation")


@pytest.mark.parametrize(
    "overrides, kind, message",
    [
        (
            dict(pretrain_gmf_dir="/g"),
            NEUMF,
            "NeuMF starts from a pretrained GMF and a pretrained MLP model together: give "
            "--pretrain_mlp_dir too (or neither)",
        ),
        (
            dict(pretrain_mlp_dir="/m"),
            NEUMF,
            "give --pretrain_gmf_dir too",
        ),
        (
            dict(pretrain_alpha=0.8),
            NEUMF,
            "--pretrain_alpha weighs the pretrained GMF and MLP models: give "
            "--pretrain_gmf_dir and --pretrain_mlp_dir, or drop it",
        ),
        (
            dict(pretrain_gmf_dir="/g", pretrain_mlp_dir="/m"),
            GMF,
            "--pretrain_gmf_dir and --pretrain_mlp_dir start a NeuMF model, not --model gmf",
        ),
    ],
)
def test_pretrain_flags_that_cannot_go_together(tmp_path, overrides, kind, message):
    config = tiny_ncf_config(tmp_path, **overrides)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model_kind=kind))
    with pytest.raises(ValueError, match=re.escape(message)):
        cycles.run(config)
    assert not (tmp_path / "model").exists()  # refused before anything is written


@pytest.mark.integration
def test_the_command_line_reports_a_missing_pretrained_model_in_one_line(tmp_path):
    result = run_module(
        "recommendation.ncf_main",
        *TINY_NCF_MAIN_FLAGS,
        f"--data_dir={tmp_path}",
        f"--model_dir={tmp_path / 'model'}",
        f"--pretrain_gmf_dir={tmp_path / 'gmf'}",
        f"--pretrain_mlp_dir={tmp_path / 'mlp'}",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (
        f"error: --pretrain_gmf_dir {tmp_path / 'gmf'} holds no checkpoint: train it first "
        f"with ncf-main --model gmf --model_dir {tmp_path / 'gmf'} (and this run's data flags)"
    )


# ---------------------------------------------------------------------------
# The recipe end to end: GMF, MLP, then NeuMF from both, each selected on validation.


def _stage(root, kind: str, **overrides):
    config = tiny_ncf_config(
        root, model_dir=str(root / kind), benchmark_log_dir=str(root / f"bench_{kind}")
    )
    model = dataclasses.replace(config.model, model_kind=kind, learning_rate=0.05)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, eval_split=constants.VALIDATION_SPLIT),
        model=model,
    )
    return dataclasses.replace(config, **overrides)


def _pretrained_stage(root, model_dir: str, **overrides):
    config = _stage(
        root,
        NEUMF,
        model_dir=str(root / model_dir),
        pretrain_gmf_dir=str(root / GMF),
        pretrain_mlp_dir=str(root / MLP),
        **overrides,
    )
    model = dataclasses.replace(config.model, optimizer="sgd", learning_rate=0.5)
    return dataclasses.replace(config, model=model)


def test_gmf_then_mlp_then_pretrained_neumf(tmp_path, monkeypatch):
    stages = {}
    for kind in (GMF, MLP):
        config = _stage(tmp_path, kind, export_dir=str(tmp_path / f"export_{kind}"))
        stages[kind] = cycles.run(config)
        # The tiny data's seed 1: the test items of 156 (GMF) and 97 (MLP) of the 300
        # users in their top 10 at the epoch chosen on validation, on the CPUs this was
        # written on (another CPU's rounding may move a near-tie: a user or two).
        hits = stages[kind].summary["test_hr"] * 300
        assert abs(hits - {GMF: 156, MLP: 97}[kind]) <= 2
        # Its export serves: the top item's score is that pair's score.
        served = tf.saved_model.load(str(tmp_path / f"export_{kind}"))
        top = served.signatures["recommend"](
            user_id=tf.constant([1], tf.int64), k=tf.constant(1), exclude_seen=tf.constant(True)
        )
        pair = served.signatures["serving_default"](
            user_id=tf.constant([1], tf.int64), item_id=top["item_ids"][0]
        )
        np.testing.assert_allclose(pair["scores"], top["scores"][0], rtol=1e-5)

    neumf = cycles.run(_pretrained_stage(tmp_path, "neumf")).summary
    assert abs(neumf["test_hr"] * 300 - 154) <= 2 and neumf["epochs"] == 2  # as above

    # What a fresh NeuMF run starts from: the two selected models (each run ends holding
    # its selected epoch's weights), combined.
    config = _pretrained_stage(tmp_path, "fresh")
    data = preprocessing_cache.load_or_build(config.data).data
    strategy = distribution_utils.get_distribution_strategy("one_device", None)
    start = cycles._make_runner(config, data, strategy).state.model
    users = tf.range(data.num_users)
    expected = 0.5 * stages[GMF].runner.state.model.score_all_items(users)
    expected += 0.5 * stages[MLP].runner.state.model.score_all_items(users)
    np.testing.assert_allclose(start.score_all_items(users), expected, rtol=1e-5, atol=1e-5)

    # Resumed, it restores its own checkpoint and trains on from it, pretraining nothing.
    def refuse(*_):
        raise AssertionError("a resumed run pretrained")

    monkeypatch.setattr(pretrain, "start_from_pretrained", refuse)
    resumed = cycles.run(_pretrained_stage(tmp_path, "neumf", train_epochs=3)).summary
    assert resumed["epochs"] == 3 and not resumed.get("resumed_finished_run")
    monkeypatch.undo()
    # The same seed repeats the same run.
    again = cycles.run(_pretrained_stage(tmp_path, "again")).summary
    keys = ("best_epoch", "best_hr", "best_ndcg", "test_hr", "test_ndcg")
    assert [again[key] for key in keys] == [neumf[key] for key in keys]
