#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU, writing one table:
#   (a) training throughput at the MLPerf model size (factors 64, layers 256-256-128-64)
#       on synthetic batches, bf16 and XLA, for the largest batch of BATCHES that fits;
#   (b) the ml-20m-shaped MLPerf run end to end (scripts/benchmark_ml20m.py, 2 epochs:
#       its smallest run, since the trainer's wait after the first cycle needs two);
#   (c) the tests whose code paths change on a GPU (distribution, runner, model).
# Anchor: >= 40 M training samples/s on one H200.
#
#   pip install -e ".[test]" "tensorflow[and-cuda]>=2.21,<2.22"   # once, on that machine
#   scripts/accelerator_check.sh [OUT_DIR]
#
# Needs TensorFlow with CUDA on the machine: never part of CI (tests need no GPU).
set -uo pipefail

OUT_DIR="${1:-${OUT:-./accelerator_check}}"
WORK="${WORK:-/tmp/ncf-accelerator-check}"
BATCHES="${BATCHES:-1048576 524288 262144 131072}"
PYTHON="${PYTHON:-python}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT_DIR" "$WORK"
TABLE="$OUT_DIR/accelerator_check.md"
cd "$ROOT"

if ! "$PYTHON" -c "import tensorflow as tf, sys; sys.exit(not tf.config.list_physical_devices('GPU'))"; then
  echo "error: TensorFlow sees no GPU here (install tensorflow[and-cuda] on a GPU machine)" >&2
  exit 2
fi
{
  echo "# Accelerator check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "CPU: $("$PYTHON" -c 'from official.utils.misc import machine; print(machine.describe_cpu())'), $(nproc) cores"
  echo
  echo "| check | result |"
  echo "| --- | --- |"
} > "$TABLE"

# (a) The largest batch that fits, bf16 + XLA, 8 steps per call, synthetic batches.
THROUGHPUT="not run"
for batch in $BATCHES; do
  log="$WORK/throughput_$batch.log"
  if "$PYTHON" -m recommendation.ncf_main --dataset=synthetic --use_synthetic_data \
      --synthetic_num_users=138493 --synthetic_num_items=26744 \
      --synthetic_num_ratings=3000000 --data_dir="$WORK/throughput_data" \
      --num_factors=64 --layers=256,256,128,64 --mlp_regularization=0,0,0,0 \
      --batch_size="$batch" --dtype=bf16 --enable_xla --batches_per_step=8 \
      --train_epochs=20 --model_dir="$WORK/throughput_model" --clean > "$log" 2>&1; then
    rate=$(grep -o "synthetic throughput: [0-9,]*" "$log" | tail -1 | grep -o "[0-9,]*$")
    THROUGHPUT="batch $batch: ${rate:-?} samples/s (bf16, XLA; target 40,000,000)"
    break
  fi
  THROUGHPUT="batch $batch failed: $(grep -m1 -o "error:.*\|ResourceExhausted.*" "$log" | cut -c1-160)"
done
echo "| (a) training throughput, MLPerf model size | $THROUGHPUT |" >> "$TABLE"

# (b) The ml-20m-shaped run, end to end.
RATINGS="$WORK/data/ml-20m/ratings.csv"
if [[ ! -f "$RATINGS" ]]; then
  "$PYTHON" -m recommendation.data.synthetic_data --shape ml-20m --data_dir "$WORK/data" \
    > "$WORK/synthetic.log" 2>&1
fi
if "$PYTHON" scripts/benchmark_ml20m.py --ratings "$RATINGS" --work_dir "$WORK/ml20m" \
    --train_epochs 2 > "$WORK/ml20m.log" 2>&1; then
  grep -v "^[IWE][0-9]" "$WORK/ml20m.log" | grep -v "^command:\|^cpu:" \
    | sed 's/^\(.*[^ ]\)  \+\(.*\)$/| (b) \1 | \2 |/;t;s/^\(.\+\)$/| (b) | \1 |/' >> "$TABLE"
else
  echo "| (b) ml-20m-shaped run | failed: $(tail -1 "$WORK/ml20m.log" | cut -c1-200) |" >> "$TABLE"
fi

# (c) The tests that take other code paths with a GPU present.
if "$PYTHON" -m pytest -q tests/test_distribution.py tests/test_runner.py \
    tests/test_neumf_model.py > "$WORK/tests.log" 2>&1; then
  status="passed"
else
  status="FAILED"
fi
echo "| (c) GPU-relevant tests | $status: $(tail -1 "$WORK/tests.log") |" >> "$TABLE"
cp "$WORK"/*.log "$OUT_DIR"/ 2>/dev/null
cat "$TABLE"
