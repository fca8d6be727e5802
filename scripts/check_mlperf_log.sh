#!/usr/bin/env bash
# Checks an NCF MLPerf compliance log (mllog format) with the official checker and
# this project's NCF rules; exits non-zero if the log fails.
#
#   scripts/check_mlperf_log.sh /tmp/ncf/mlperf_compliance.log
#
# The checker resolves --config against its own folder, so the rules path is made
# absolute. Its report goes to the terminal only (--log_output /dev/null).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 LOG" >&2
  exit 2
fi
if [[ ! -f "$1" ]]; then
  echo "error: no log at $1 (run ncf-main with --output_ml_perf_compliance_logging)" >&2
  exit 2
fi
RULES="$(cd "$(dirname "$0")/.." && pwd)/recommendation/mlperf/ncf_rules.yaml"
exec "${PYTHON:-python}" -m mlperf_logging.compliance_checker \
  --usage training --ruleset 0.7.0 --config "$RULES" --log_output /dev/null "$1"
