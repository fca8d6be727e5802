"""Base flags every benchmark needs: where the model lives and how long to train."""

from absl import flags

from official.utils.flags import core


def define_base(
    default_model_dir: str = "/tmp/model",
    default_batch_size: int = 32,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> None:
    """Defines --model_dir --clean --train_epochs --epochs_between_evals --batch_size
    --eval_batch_size --export_dir --run_eagerly (Model Garden names and short names)."""
    flags.DEFINE_string(
        "model_dir",
        default_model_dir,
        "Where checkpoints, summaries and logs are written.",
        short_name="md",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "clean",
        False,
        "Delete model_dir before training instead of resuming from it.",
        short_name="cl",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "train_epochs",
        1,
        "Epochs to train before stopping.",
        short_name="te",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "epochs_between_evals",
        1,
        "Training epochs between evaluations.",
        short_name="ebe",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "batch_size",
        default_batch_size,
        "Global training batch size (split across replicas).",
        short_name="bs",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "eval_batch_size",
        None,
        "Global evaluation batch size; defaults to --batch_size.",
        short_name="ebs",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "export_dir",
        None,
        "If set, a SavedModel for serving is exported here.",
        short_name="ed",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "run_eagerly", False, "Run steps eagerly (slow; for debugging).", flag_values=flag_values
    )
    for name in ("train_epochs", "epochs_between_evals", "batch_size"):
        core.require_positive(name, flag_values=flag_values)
    core.require_positive("eval_batch_size", allow_none=True, flag_values=flag_values)
