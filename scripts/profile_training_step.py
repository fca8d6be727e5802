"""Where a training step's time goes, at the MLPerf model size, from TensorFlow's profiler.

Runs ``ncf-main --use_synthetic_data`` (factors 64, layers 256-256-128-64, batch 65,536,
ML-1M's tables; one graph call per step and no XLA by default, so every TensorFlow op
keeps its name) under `tf.profiler`, then sums the time of each op the executor ran
(events named ``<op name>:<op type>`` on its threads) into categories: matmuls,
embedding gathers, their gradients (the scatter-adds into the tables), slicing and
its gradients, the optimizer update, casts and other element-wise work. The op times
are summed over the executor's threads, which run ops side by side: their total can
exceed the wall time, and the wall time minus what they cover is Python, dispatch and
waiting. With ``--extra_flag=--enable_xla`` the step is one compiled program: XLA is
asked to trace each kernel (``--xla_cpu_enable_xprof_traceme``) and to dump its
optimised HLO, and each kernel (``MatMul.30``, ``wrapped_scatter.1``) is counted as the
TensorFlow op its HLO came from (the metadata XLA keeps), so both modes fall into the
same categories.

    python scripts/profile_training_step.py --ratings ../shared/data/ml-1m/ratings.dat \
        [--extra_flag=--inter_op_parallelism_threads=1] [--list_ops 45]

(With one inter-op thread the ops run one at a time, so their times add up to the
step's instead of overlapping.)
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import tempfile

from absl import flags

from official.utils.misc import machine
from recommendation.training import cycles, ncf_common

# Categories in order of precedence: the first whose test an op meets takes it.
CATEGORIES = (
    ("optimizer update (Adam)", lambda name, kind: "adam" in name.lower()),
    (
        "embedding gradients (scatter-add)",
        lambda name, kind: kind in {"UnsortedSegmentSum", "TensorScatterAdd"},
    ),
    ("matmuls (forward and backward)", lambda name, kind: "MatMul" in kind),
    (
        "embedding and table-term gathers",
        lambda name, kind: kind.startswith(("Gather", "ResourceGather")),
    ),
    (
        "slicing and its gradients",
        lambda name, kind: (
            kind in {"StridedSlice", "StridedSliceGrad", "Slice", "ConcatV2", "Split", "SplitV"}
        ),
    ),
    ("casts", lambda name, kind: kind == "Cast"),
    ("other element-wise and reductions", lambda name, kind: True),
)


def xspace_class():
    """TensorFlow's profile proto, ``XSpace``. Not public API: its module is the one
    TensorFlow 2.21 ships (tests/test_profile_training_step.py fails if it moves)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2.XSpace


XLA_PROFILE_FLAGS = "--xla_cpu_enable_xprof_traceme=true --xla_dump_hlo_as_text"
# An instruction of the optimised HLO and the TensorFlow op it came from.
_HLO_LINE = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*metadata=\{op_type="([^"]+)" op_name="([^"]+)"')


def hlo_sources(dump_dir: str) -> dict[str, str]:
    """``{HLO instruction: "<op name>:<op type>"}`` from XLA's optimised-HLO dumps in
    `dump_dir`: the TensorFlow op each compiled kernel computes (a fusion carries its
    root's), so that XLA's kernels are sorted like the executor's ops."""
    sources = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations.txt"))):
        with open(path) as stream:
            for line in stream:
                found = _HLO_LINE.match(line)
                if found:
                    sources[found.group(1)] = f"{found.group(3)}:{found.group(2)}"
    return sources


def op_seconds(xplane_path: str, sources: dict[str, str] | None = None) -> collections.Counter:
    """Seconds per ``<op name>:<op type>`` that the host's executor threads spent; XLA
    kernels named in `sources` (`hlo_sources`) are counted as the op they came from."""
    sources = sources or {}
    space = xspace_class()()
    with open(xplane_path, "rb") as stream:
        space.ParseFromString(stream.read())
    seconds: collections.Counter = collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            executor = line.name.startswith(("tf_Compute", "tf_numa"))
            for event in line.events:
                name = names[event.metadata_id]
                if name in sources:  # an XLA kernel, on whichever thread ran it
                    seconds[sources[name]] += event.duration_ps / 1e12
                elif executor and "::" not in name and not name.startswith("end: "):
                    if ":" in name or line.name.startswith("tf_numa"):
                        seconds[name] += event.duration_ps / 1e12
    return seconds


def categorise(seconds: collections.Counter) -> dict[str, collections.Counter]:
    """`seconds` split by `CATEGORIES`."""
    split = {category: collections.Counter() for category, _ in CATEGORIES}
    for full_name, value in seconds.items():
        # An XLA kernel has no op type: its HLO name (``MatMul.30``) stands for one.
        name, _, kind = (
            full_name.rpartition(":") if ":" in full_name else (full_name, "", full_name)
        )
        category = next(c for c, test in CATEGORIES if test(name, kind))
        split[category][full_name] += value
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratings", required=True, help="ML-1M ratings.dat (its table sizes)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--extra_flag", action="append", default=[], help="passed to ncf-main")
    parser.add_argument(
        "--list_ops", type=int, default=0, help="also list this many largest ops, ms per step"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        hlo_dir = os.path.join(work, "hlo")
        # XLA reads its flags at its first compilation, which comes after this.
        flags_now = [os.environ.get("XLA_FLAGS", ""), XLA_PROFILE_FLAGS]
        os.environ["XLA_FLAGS"] = " ".join([*flags_now, f"--xla_dump_to={hlo_dir}"]).strip()
        import tensorflow as tf  # after argparse: --help stays fast

        data_dir = os.path.join(work, "data")
        os.makedirs(os.path.join(data_dir, "ml-1m"))
        os.symlink(os.path.abspath(args.ratings), os.path.join(data_dir, "ml-1m", "ratings.dat"))
        ncf_common.define_ncf_flags()
        flag_line = [
            "--dataset=ml-1m",
            f"--data_dir={data_dir}",
            f"--model_dir={work}/model",
            "--use_synthetic_data",
            "--num_factors=64",
            "--layers=256,256,128,64",
            "--mlp_regularization=0,0,0,0",
            "--batch_size=65536",
            f"--train_epochs={args.epochs}",
            "--nouse_xla",
            "--batches_per_step=1",
            *args.extra_flag,
        ]
        ncf_common.parse_ncf_flags(["ncf-main", *flag_line])
        config = ncf_common.ncf_config_from_flags(flags.FLAGS)
        tf.profiler.experimental.start(os.path.join(work, "profile"))
        summary = cycles.run(config).summary
        tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(work, "profile", "plugins", "profile", "*", "*.xplane.pb"))
        seconds = op_seconds(path, hlo_sources(hlo_dir))
    split = categorise(seconds)
    total = sum(seconds.values())
    print(machine.cpu_line())
    print("flags:", " ".join(flag_line[3:]))
    print(
        f"training: {summary['train_points']:,.0f} examples in {summary['train_seconds']:.1f} s "
        f"({summary['examples_per_second']:,.0f} examples/s, first call's tracing included); "
        f"op time summed over the executor's threads: {total:.1f} s"
    )
    print(f"{'category':<36} {'op s':>7} {'share':>6}  largest ops")
    for category, ops in sorted(split.items(), key=lambda item: -sum(item[1].values())):
        value = sum(ops.values())
        top = ", ".join(f"{name} {s:.2f}" for name, s in ops.most_common(3))
        print(f"{category:<36} {value:>7.2f} {value / total:>6.1%}  {top}")
    if args.list_ops:
        steps = math.ceil(summary["train_points"] / config.batch_size)
        print(f"the {args.list_ops} largest ops, ms per step ({steps} steps):")
        for name, value in seconds.most_common(args.list_ops):
            print(f"  {1e3 * value / steps:8.2f}  {name}")


if __name__ == "__main__":
    main()
