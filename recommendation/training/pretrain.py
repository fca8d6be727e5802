"""Pre-training: a fresh NeuMF run starts from the GMF and MLP models of finished
``--model gmf`` and ``--model mlp`` runs (`start_from_pretrained`), each checked to be
the kind and sizes the run needs, read from its checkpoint (`describe_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf
from absl import logging

from official.core import model_dir
from official.core.model_dir import ModelDirError
from official.core.runner import (
    BEST_FOLDER,
    Runner,
    restore_model,
)
from recommendation.data import constants
from recommendation.model import hyperparams, network
from recommendation.training import selection
from recommendation.training.ncf_common import NcfConfig


def check_pretrain(config: NcfConfig) -> None:
    """Rejects pre-training flags that cannot work together.

    Raises:
        ValueError: One pretrained model without the other, pre-training for a model
            other than NeuMF, or an alpha with nothing to weigh.
    """
    given = [bool(config.pretrain_gmf_dir), bool(config.pretrain_mlp_dir)]
    if not any(given):
        if config.pretrain_alpha != NcfConfig.pretrain_alpha:
            raise ValueError(
                "--pretrain_alpha weighs the pretrained GMF and MLP models: give "
                "--pretrain_gmf_dir and --pretrain_mlp_dir, or drop it"
            )
        return
    if not all(given):
        missing = "--pretrain_mlp_dir" if given[0] else "--pretrain_gmf_dir"
        raise ValueError(
            "NeuMF starts from a pretrained GMF and a pretrained MLP model together: give "
            f"{missing} too (or neither)"
        )
    if config.model.model_kind != hyperparams.NEUMF:
        raise ValueError(
            f"--pretrain_gmf_dir and --pretrain_mlp_dir start a NeuMF model, not "
            f"--model {config.model.model_kind}: drop them, or train --model neumf"
        )


# "holds a GMF model": each kind with its article.
_A_KIND = {hyperparams.NEUMF: "a NeuMF", hyperparams.GMF: "a GMF", hyperparams.MLP: "an MLP"}


def start_from_pretrained(config: NcfConfig, runner: Runner) -> None:
    """Sets the runner's NeuMF from the GMF and MLP models of the runs in
    ``config.pretrain_gmf_dir`` and ``config.pretrain_mlp_dir`` (`combine_pretrained`,
    alpha ``config.pretrain_alpha``); the optimiser starts afresh.

    Raises:
        ModelDirError: A folder holds no checkpoint, a run of the other --eval_split, or
            a model of another kind or other sizes than this run's.
    """
    models = {}
    for kind, directory in (
        (hyperparams.GMF, config.pretrain_gmf_dir),
        (hyperparams.MLP, config.pretrain_mlp_dir),
    ):
        params = dataclasses.replace(runner.params, model_kind=kind)
        models[kind] = network.build_model(params)
        path, best = _pretrained_checkpoint(config, kind, directory)
        _check_pretrained_sizes(kind, directory, path, params)
        restore_model(models[kind], directory, best)
        logging.info("Pretrained %s model: %s", kind.upper(), path)
    network.combine_pretrained(
        runner.state.model,
        models[hyperparams.GMF],
        models[hyperparams.MLP],
        config.pretrain_alpha,
    )
    logging.info("NeuMF starts from the pretrained models (alpha %g)", config.pretrain_alpha)


def _pretrained_checkpoint(config: NcfConfig, kind: str, directory: str) -> tuple[str, bool]:
    """The checkpoint of the run in `directory` that pre-training reads, and whether it
    is a kept best: the latest, or of a validation run the selected one
    (``MODEL_DIR/best``).

    Raises:
        ModelDirError: There is none, every one is damaged, or the run evaluated on the
            other split (so it trained on other data: with or without the validation
            items).
    """
    flag = f"--pretrain_{kind}_dir"
    if tf.train.latest_checkpoint(directory) is None:
        raise ModelDirError(
            f"{flag} {directory} holds no checkpoint: train it first with "
            f"ncf-main --model {kind} --model_dir {directory} (and this run's data flags)"
        )
    validated = tf.io.gfile.exists(os.path.join(directory, selection.VALIDATION_HISTORY_FILE))
    split = config.data.eval_split
    if validated != (split == constants.VALIDATION_SPLIT):
        theirs = constants.VALIDATION_SPLIT if validated else "test"
        raise ModelDirError(
            f"{flag} {directory} holds a run of --eval_split {theirs}, which trained on "
            f"other data than this run of --eval_split {split}: pretrain with "
            f"--eval_split {split}"
        )
    # The newest intact one: what `restore_model` restores (a damaged one is passed over).
    if not validated:
        return model_dir.newest_intact(directory), False
    best = model_dir.newest_intact(os.path.join(directory, BEST_FOLDER))
    if best is None:
        raise ModelDirError(
            f"{flag} {directory} has no selected checkpoint in {BEST_FOLDER}/ (stopped "
            "before its first evaluation): resume that run first"
        )
    return best, True


def _check_pretrained_sizes(
    kind: str, directory: str, path: str, params: hyperparams.ModelParams
) -> None:
    """Checks that the model in checkpoint `path` is a `kind` model of `params`' sizes.

    Raises:
        ModelDirError: It is another kind of model, or of other sizes (saying which).
    """
    flag = f"--pretrain_{kind}_dir"
    found = describe_checkpoint(path)
    if found["kind"] != kind:
        # An MF model is a GMF model (its weights fixed at 1): both pretrain the GMF part.
        models = "gmf or mf" if kind == hyperparams.GMF else kind
        raise ModelDirError(
            f"{flag} {directory} holds {_A_KIND[found['kind']]} model ({path}), not "
            f"{_A_KIND[kind]} one: give the model_dir of an ncf-main --model {models} run"
        )
    if (found["users"], found["items"]) != (params.num_users, params.num_items):
        raise ModelDirError(
            f"{flag} {directory} holds a model of {found['users']:,} users and "
            f"{found['items']:,} items, this run's data has {params.num_users:,} and "
            f"{params.num_items:,}: pretrain on the same --dataset and data flags"
        )
    flag_name, ours = (
        ("--num_factors", params.mf_dim) if kind == hyperparams.GMF else ("--layers", params.layers)
    )
    theirs = found["factors"] if kind == hyperparams.GMF else found["layers"]
    if theirs != ours:
        raise ModelDirError(
            f"{flag} {directory} holds {_A_KIND[kind]} model of {flag_name} "
            f"{_flag_text(theirs)}, this run has {flag_name} {_flag_text(ours)}: pretrain "
            f"with the same {flag_name}"
        )


def _flag_text(value: int | tuple[int, ...]) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def describe_checkpoint(path: str) -> dict:
    """The kind and sizes of the NeuMF, GMF or MLP model in a Runner checkpoint (the
    latest of a run or its kept best), read from the shapes of its weights.

    The kinds tell apart by the logit layer's input: a GMF model's is its table width,
    an MLP model's its last layer (or, without hidden layers, both table halves), and
    NeuMF's their sum. Returns ``kind``, ``users``, ``items``, ``factors`` (None for
    MLP) and ``layers`` (None for GMF).
    """
    user, item, *hidden, logit = _matrix_shapes(path)
    width, rows = user[1], logit[0]
    if hidden:
        layers = (hidden[0][0], *(kernel[1] for kernel in hidden))
        factors = rows - layers[-1]
    elif rows == width:
        layers, factors = None, width
    else:  # the MLP input straight to the logit: rows = factors + 2 x (width - factors)
        layers, factors = (2 * (rows - width),), 2 * width - rows
    kind = hyperparams.NEUMF
    if layers is None:
        kind = hyperparams.GMF
    elif factors == 0:
        kind, factors = hyperparams.MLP, None
    return {"kind": kind, "users": user[0], "items": item[0], "factors": factors, "layers": layers}


def _matrix_shapes(path: str) -> list[list[int]]:
    """The shapes of the user and item tables, the MLP kernels and the logit kernel in
    checkpoint `path`, in that order: a kept best lists the weights as the model does,
    a run's checkpoint by attribute (``model/<layer>/...``)."""
    shapes = dict(tf.train.list_variables(path))
    listed = sorted(
        (int(key.split("/")[1]), shape)
        for key, shape in shapes.items()
        if key.startswith("weights/")
    )
    if listed:
        return [shape for _, shape in listed if len(shape) == 2]
    by_layer = {
        key.split("/")[1]: shape
        for key, shape in shapes.items()
        if key.startswith("model/") and len(shape) == 2
    }
    hidden = sorted(
        (name for name in by_layer if name.startswith("mlp_")), key=lambda n: int(n[4:])
    )
    names = ["user_embedding", "item_embedding", *hidden, "logit"]
    return [by_layer[name] for name in names]
