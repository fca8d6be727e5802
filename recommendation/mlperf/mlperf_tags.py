"""NCF's MLPerf v0.5 tag set: what a ``--mlperf_log_format v0.5`` log holds.

The tags are the old ``mlperf_compliance`` package's NCF set, as MLPerf v0.5 NCF
results were logged; the trainer (`ncf_main`) and the producer process
(`data_async_generation`) both log through it.
"""

from __future__ import annotations

from mlperf_logging.mllog import constants as mllog_constants

from official.utils.logs.mlperf_helper import V05TagSet

V05_TAGS = V05TagSet(
    tags=frozenset(
        {
            "run_clear_caches",
            "run_set_random_seed",
            "run_start",
            "preproc_hp_min_ratings",
            "preproc_hp_num_eval",
            "preproc_hp_sample_eval_replacement",
            "input_hp_num_neg",
            "input_hp_sample_train_replacement",
            "input_step_train_neg_gen",
            "input_step_eval_neg_gen",
            "input_size",
            "input_batch_size",
            "model_hp_mf_dim",
            "model_hp_mlp_layer_sizes",
            "opt_learning_rate",
            "opt_hp_adam_beta1",
            "opt_hp_adam_beta2",
            "opt_hp_adam_epsilon",
            "model_hp_loss_fn",
            "train_loop",
            "train_epoch",
            "eval_start",
            "eval_size",
            "eval_target",
            "eval_accuracy",
            "eval_hp_num_users",
            "eval_hp_num_neg",
            "eval_stop",
            "run_stop",
            "run_final",
        }
    ),
    # mllog key -> the v0.5 tag of the same event.
    renamed={
        mllog_constants.CACHE_CLEAR: "run_clear_caches",
        mllog_constants.GLOBAL_BATCH_SIZE: "input_batch_size",
        mllog_constants.OPT_BASE_LR: "opt_learning_rate",
        mllog_constants.OPT_ADAM_BETA_1: "opt_hp_adam_beta1",
        mllog_constants.OPT_ADAM_BETA_2: "opt_hp_adam_beta2",
        mllog_constants.OPT_ADAM_EPSILON: "opt_hp_adam_epsilon",
        mllog_constants.SEED: "run_set_random_seed",
        mllog_constants.EPOCH_START: "train_epoch",
        # NCF's evaluation samples are its users.
        mllog_constants.EVAL_SAMPLES: "eval_hp_num_users",
    },
)
