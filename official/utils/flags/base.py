"""Base flags every benchmark needs: where the model lives and how long to train.

Rows set the config fields of the same names; each program's config holds the defaults.
"""

from official.utils.flags.core import POSITIVE, POSITIVE_OR_UNSET, FlagSpec

BASE_FLAGS = (
    FlagSpec("model_dir", "Where checkpoints, summaries and logs are written.", short_name="md"),
    FlagSpec(
        "clean", "Delete model_dir before training instead of resuming from it.", short_name="cl"
    ),
    FlagSpec(
        "train_epochs", "Epochs to train before stopping.", short_name="te", checks=(POSITIVE,)
    ),
    FlagSpec(
        "epochs_between_evals",
        "Training epochs between evaluations.",
        short_name="ebe",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "batch_size",
        "Global training batch size (split across replicas).",
        short_name="bs",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "eval_batch_size",
        "Global evaluation batch size; defaults to --batch_size.",
        short_name="ebs",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec("export_dir", "If set, a SavedModel for serving is exported here.", short_name="ed"),
    FlagSpec("run_eagerly", "Run steps eagerly (slow; for debugging)."),
)
