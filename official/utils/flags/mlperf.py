"""MLPerf compliance logging flags (the reference's switch plus the log and metadata)."""

from __future__ import annotations

import dataclasses
import os

from absl import flags
from mlperf_logging.mllog import constants as mllog_constants

from official.utils.flags.core import (
    EMPTY_AS_UNSET,
    Check,
    FlagSpec,
    Rule,
    config_from_flags,
    define_flags,
)
from official.utils.logs import mlperf_helper

DIVISIONS = (mllog_constants.CLOSED, mllog_constants.OPEN)
STATUSES = (
    mllog_constants.ONPREM,
    mllog_constants.CLOUD,
    "preview",
    mllog_constants.RESEARCH,
)


_NOT_EMPTY = Check(
    lambda value: bool(value and value.strip()),
    "--{flag} must not be empty (the compliance checker requires it)",
)

# Rows setting the fields of `mlperf_helper.MlperfOptions`, which holds the defaults.
MLPERF_FLAGS = (
    FlagSpec(
        "mlperf_log_file",
        f"Where the compliance log goes (default MODEL_DIR/{mlperf_helper.DEFAULT_LOG_FILE}); "
        "replaced at the start of each run.",
        field="log_file",
        **EMPTY_AS_UNSET,
    ),
    FlagSpec(
        "mlperf_log_format",
        "mllog (:::MLLOG lines, read by mlperf_logging.compliance_checker) or v0.5 "
        "(:::MLPv0.5.0 lines, as MLPerf v0.5 NCF results were logged).",
        field="log_format",
        choices=tuple(mlperf_helper.FORMATS),
    ),
    FlagSpec(
        "mlperf_submission_org",
        "submission_org of the log.",
        field="org",
        checks=(_NOT_EMPTY,),
    ),
    FlagSpec(
        "mlperf_submission_platform",
        "submission_platform of the log (the system, e.g. 1xH100).",
        field="platform",
        checks=(_NOT_EMPTY,),
    ),
    FlagSpec(
        "mlperf_submission_division",
        "submission_division: closed fixes the NCF protocol and target, open does not.",
        field="division",
        choices=DIVISIONS,
    ),
    FlagSpec(
        "mlperf_submission_status",
        "submission_status of the log.",
        field="status",
        choices=STATUSES,
    ),
    FlagSpec(
        "mlperf_clear_caches",
        "Drop the OS page cache before the run (needs root), as MLPerf requires; "
        "--nomlperf_clear_caches on shared machines (the log records it).",
        field="clear_caches",
    ),
    Rule(
        ("output_ml_perf_compliance_logging", "mlperf_log_file", "mlperf_log_format"),
        lambda values: (
            values["output_ml_perf_compliance_logging"]
            or (
                not values["mlperf_log_file"] and values["mlperf_log_format"] == mlperf_helper.MLLOG
            )
        ),
        "--mlperf_log_file and --mlperf_log_format need "
        "--output_ml_perf_compliance_logging (without it no log is written)",
    ),
)
_DEFAULTS = mlperf_helper.MlperfOptions(log_file="")


def define_mlperf(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --output_ml_perf_compliance_logging, --mlperf_log_file,
    --mlperf_log_format, --mlperf_clear_caches and the --mlperf_submission_* metadata."""
    # The switch sets no field: it decides whether there are options at all.
    flags.DEFINE_boolean(
        "output_ml_perf_compliance_logging",
        False,
        "Write an MLPerf compliance log (see --mlperf_log_file).",
        flag_values=flag_values,
    )
    define_flags(MLPERF_FLAGS, _DEFAULTS, flag_values)


def mlperf_options_from_flags(
    flag_values: flags.FlagValues, default_dir: str, benchmark: str
) -> mlperf_helper.MlperfOptions | None:
    """The compliance log the parsed flags ask for, or None when it is off."""
    if not flag_values.output_ml_perf_compliance_logging:
        return None
    options = config_from_flags(
        MLPERF_FLAGS, dataclasses.replace(_DEFAULTS, benchmark=benchmark), flag_values
    )
    log_file = options.log_file or os.path.join(default_dir, mlperf_helper.DEFAULT_LOG_FILE)
    return dataclasses.replace(options, log_file=log_file)
