"""MLPerf compliance logging flags (the reference's switch plus the log and metadata)."""

from __future__ import annotations

import os

from absl import flags
from mlperf_logging.mllog import constants as mllog_constants

from official.utils.logs import mlperf_helper

DIVISIONS = (mllog_constants.CLOSED, mllog_constants.OPEN)
STATUSES = (
    mllog_constants.ONPREM,
    mllog_constants.CLOUD,
    "preview",
    mllog_constants.RESEARCH,
)


def define_mlperf(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --output_ml_perf_compliance_logging, --mlperf_log_file,
    --mlperf_log_format, --mlperf_clear_caches and the --mlperf_submission_* metadata."""
    fv = flag_values
    flags.DEFINE_boolean(
        "output_ml_perf_compliance_logging",
        False,
        "Write an MLPerf compliance log (see --mlperf_log_file).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "mlperf_log_file",
        None,
        f"Where the compliance log goes (default MODEL_DIR/{mlperf_helper.DEFAULT_LOG_FILE}); "
        "replaced at the start of each run.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "mlperf_log_format",
        mlperf_helper.MLLOG,
        list(mlperf_helper.FORMATS),
        "mllog (:::MLLOG lines, read by mlperf_logging.compliance_checker) or v0.5 "
        "(:::MLPv0.5.0 lines, as MLPerf v0.5 NCF results were logged).",
        flag_values=fv,
    )
    default = mlperf_helper.MlperfOptions(log_file="")
    flags.DEFINE_string(
        "mlperf_submission_org", default.org, "submission_org of the log.", flag_values=fv
    )
    flags.DEFINE_string(
        "mlperf_submission_platform",
        default.platform,
        "submission_platform of the log (the system, e.g. 1xH100).",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "mlperf_submission_division",
        default.division,
        list(DIVISIONS),
        "submission_division: closed fixes the NCF protocol and target, open does not.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "mlperf_submission_status",
        default.status,
        list(STATUSES),
        "submission_status of the log.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "mlperf_clear_caches",
        default.clear_caches,
        "Drop the OS page cache before the run (needs root), as MLPerf requires; "
        "--nomlperf_clear_caches on shared machines (the log records it).",
        flag_values=fv,
    )
    for name in ("mlperf_submission_org", "mlperf_submission_platform"):
        flags.register_validator(
            name,
            lambda value: bool(value and value.strip()),
            message=f"--{name} must not be empty (the compliance checker requires it)",
            flag_values=fv,
        )
    flags.register_multi_flags_validator(
        ["output_ml_perf_compliance_logging", "mlperf_log_file", "mlperf_log_format"],
        lambda values: (
            values["output_ml_perf_compliance_logging"]
            or (
                not values["mlperf_log_file"] and values["mlperf_log_format"] == mlperf_helper.MLLOG
            )
        ),
        message="--mlperf_log_file and --mlperf_log_format need "
        "--output_ml_perf_compliance_logging (without it no log is written)",
        flag_values=fv,
    )


def mlperf_options_from_flags(
    flag_values: flags.FlagValues, default_dir: str, benchmark: str
) -> mlperf_helper.MlperfOptions | None:
    """The compliance log the parsed flags ask for, or None when it is off."""
    fv = flag_values
    if not fv.output_ml_perf_compliance_logging:
        return None
    return mlperf_helper.MlperfOptions(
        log_file=fv.mlperf_log_file or os.path.join(default_dir, mlperf_helper.DEFAULT_LOG_FILE),
        log_format=fv.mlperf_log_format,
        benchmark=benchmark,
        org=fv.mlperf_submission_org,
        platform=fv.mlperf_submission_platform,
        division=fv.mlperf_submission_division,
        status=fv.mlperf_submission_status,
        clear_caches=fv.mlperf_clear_caches,
    )
