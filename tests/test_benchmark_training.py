"""scripts/benchmark_training.py and its suites (scripts/training_benchmarks/): the model
sizes they run and count.

The suites themselves train for minutes to hours and are run by hand (their results
are in docs/benchmarks.md); these checks pin the towers and the FLOP count they report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
from conftest import SCRIPTS_DIR, load_script

from recommendation.training import experiments

sys.path.insert(0, SCRIPTS_DIR)  # as `python scripts/benchmark_training.py` has it
from training_benchmarks import (  # noqa: E402
    harness,
    paper,
    pretrained,
    resume,
    step_flops,
    throughput,
    time_to_target,
)


@pytest.fixture(scope="module")
def script():
    return load_script("benchmark_training")


@pytest.mark.parametrize(
    "factors, tower, layers",
    [
        (8, "text", "32,16,8"),  # the paper's text: "layers 32 -> 16 -> 8"
        (8, "code", "64,32,16,8"),  # the paper's code: NeuMF default [64,32,16,8]
        (8, "deep", "128,64,32,16,8"),
        (64, "text", "256,128,64"),
        (64, "code", "512,256,128,64"),
        (64, "deep", "1024,512,256,128,64"),
    ],
)
def test_paper_towers_end_in_the_predictive_factors(factors, tower, layers):
    assert paper.paper_layers(factors, tower) == layers


def test_model_flops_count_the_mlperf_model_by_hand():
    # MLP 256->256->128->64: 65,536 + 32,768 + 8,192 multiply-adds; the final layer
    # reads 64 GMF + 64 MLP values; x2 FLOPs per multiply-add, x3 forward + backward.
    assert step_flops.model_flops_per_example(64, [256, 256, 128, 64]) == 6 * (106_496 + 128)


def test_executed_flops_count_the_first_layer_once_per_step_on_the_tables():
    # ML-1M: 6,040 + 3,706 = 9,746 table rows < 2 x 65,536: the first layer (256 -> 256,
    # 393,216 FLOPs per example forward + backward) runs on the tables' 128-wide halves
    # once per step: 6 x 9,746 x 128 x 256 FLOPs shared by 65,536 examples.
    executed = step_flops.executed_flops_per_example(64, [256, 256, 128, 64], 65536, 9746)
    assert executed == pytest.approx(639_744 - 393_216 + 6 * 9746 * 128 * 256 / 65536)
    assert executed == 275_766  # 43% of the reference's 639,744
    # Tables as large as 2 x the batch: the graph is the reference's.
    assert step_flops.executed_flops_per_example(64, [256, 256, 128, 64], 100, 200) == 639_744


def test_the_step_products_are_each_layers_three_on_the_batch_or_on_the_tables():
    layers = [256, 256, 128, 64]
    projected = step_flops.step_products(64, layers, 65536, (6040, 3706))
    shapes = [product[1:] for product in projected]
    # The first layer's 128-wide halves on each table: forward, input and kernel gradient.
    assert shapes[:6] == [
        (6040, 128, 256, False, False),
        (6040, 256, 128, False, True),
        (128, 6040, 256, True, False),
        (3706, 128, 256, False, False),
        (3706, 256, 128, False, True),
        (128, 3706, 256, True, False),
    ]
    # Then 256 -> 128, 128 -> 64 and the logit (64 GMF + 64 MLP -> 1) on the batch.
    assert [shape[:3] for shape in shapes[6::3]] == [
        (65536, 256, 128),
        (65536, 128, 64),
        (65536, 128, 1),
    ]
    assert step_flops.product_flops(projected) == 275_766 * 65536
    # Without tables (or with tables as large as 2 x the batch): the reference's graph.
    reference = step_flops.step_products(64, layers, 65536)
    assert reference[0][1:] == (65536, 256, 256, False, False) and len(reference) == 12
    assert step_flops.product_flops(reference) == 639_744 * 65536
    assert step_flops.step_products(64, layers, 100, (100, 100)) == step_flops.step_products(
        64, layers, 100
    )


def test_peaks_follow_the_vector_flags_and_the_clock():
    cores = os.cpu_count() or 1
    amx = step_flops.cpu_peak_flops("avx avx2 fma avx512f amx_bf16", "CPU max MHz:  3000.0000\n")
    assert amx["fp32"][0] == cores * 3e9 * 64 and amx["bf16"][0] == cores * 3e9 * 2048
    assert "amx_bf16" in amx["bf16"][1] and "lscpu" in amx["fp32"][1]
    avx2 = step_flops.cpu_peak_flops("avx avx2 fma", "Model name: x\n")
    # No bf16 unit: bf16 runs at the fp32 rate; no clock in lscpu: 2.5 GHz, said so.
    assert avx2["fp32"][0] == avx2["bf16"][0] == cores * 2.5e9 * 32
    assert "assumed" in avx2["fp32"][1]


def test_the_wall_time_is_split_into_what_the_benchmark_log_measured():
    summary = {"kind": "summary", "total_seconds": 40.0, "first_wait_seconds": 1.5}
    summary["wait_seconds"] = 0.5
    records = [
        {"kind": "run_info"},
        {"kind": "evaluation", "train_seconds": 10.0, "eval_seconds": 2.0},
        {"kind": "evaluation", "train_seconds": 8.0, "eval_seconds": 3.0},
        summary,
    ]
    assert time_to_target.wall_time_parts(46.0, summary, records) == {
        "process start and imports": 6.0,
        "run start-up and bookkeeping": 40.0 - 18.0 - 5.0 - 2.0,
        "waiting for data": 2.0,
        "training (first calls compile)": 18.0,
        "evaluation": 5.0,
    }


def test_the_fine_tuning_rate_is_chosen_on_validation_alone():
    # 0.1 has the best test HR of any run and the best single validation HR, 0.01 the
    # best mean validation HR over the seeds: the choice is 0.01.
    runs = {
        0.001: [{"best_hr": 0.70, "test_hr": 0.67}, {"best_hr": 0.70, "test_hr": 0.67}],
        0.01: [{"best_hr": 0.71, "test_hr": 0.66}, {"best_hr": 0.71, "test_hr": 0.66}],
        0.1: [{"best_hr": 0.72, "test_hr": 0.69}, {"best_hr": 0.69, "test_hr": 0.69}],
    }
    assert pretrained.chosen_on_validation(runs) == 0.01
    # Equal means: the first setting given.
    assert pretrained.chosen_on_validation({0.5: runs[0.01], 0.2: runs[0.01]}) == 0.5


def _ncf_config(arguments: list[str]):
    """The config ncf-main builds from `arguments`."""
    from absl import flags

    from recommendation.training import ncf_common

    flag_values = flags.FlagValues()
    ncf_common.define_ncf_flags(flag_values)
    ncf_common.parse_ncf_flags(["ncf_main", *arguments], flag_values)
    return ncf_common.ncf_config_from_flags(flag_values)


def test_the_paper_options_given_override_the_experiment_but_not_the_mf_recipe():
    args = argparse.Namespace(**dict.fromkeys(paper.PAPER_OPTIONS), paper_tower="text")
    args.paper_batch_size, args.paper_epochs, args.paper_learning_rate = 256, 20, 0.002
    neumf = _ncf_config(paper.paper_arguments(args, 64, "neumf"))
    assert (neumf.batch_size, neumf.train_epochs, neumf.model.learning_rate) == (256, 20, 0.002)
    assert neumf.model.layers == (256, 128, 64) and neumf.model.mlp_regularization == (0.0,) * 3
    assert (neumf.data.dataset, neumf.data.eval_split) == ("ncf-ml-1m", "validation")
    assert (neumf.num_neg, neumf.model.embedding_init) == (4, "normal")  # the experiment's
    # The MF part is SGD at 0.008 per example: a rate of 0.008 x the batch on
    # ncf-main's batch-mean loss; its batch, rate and epochs win over the options.
    mf = _ncf_config(paper.paper_arguments(args, 64, "mf"))
    assert (mf.model.model_kind, mf.model.optimizer, mf.model.mf_dim) == ("mf", "sgd", 64)
    assert (mf.batch_size, mf.num_neg, mf.train_epochs) == (8192, 8, 64)
    assert mf.model.learning_rate == pytest.approx(0.008 * mf.batch_size)
    assert mf.model.row_regularization == 0.0025


@pytest.mark.integration
def test_the_peer_runs_without_our_pythonpath(tmp_path, monkeypatch):
    # Run from a worktree with PYTHONPATH naming it, our `official` would shadow the
    # peer's package (it has no `official.recommendation`: its setup failed so).
    peer = tmp_path / "peer.sh"
    peer.write_text('echo "args: $*"; echo "PYTHONPATH=[$PYTHONPATH] HOME=[$HOME]"\n')
    monkeypatch.setenv("PYTHONPATH", "/some/checkout")
    monkeypatch.setenv("HOME", "/home/kept")
    _, log = harness.run_peer(str(peer), ["--flag"], str(tmp_path / "peer.log"), timeout=60)
    assert "args: run --flag" in log
    assert "PYTHONPATH=[] HOME=[/home/kept]" in log


def test_each_throughput_row_runs_the_configuration_it_names():
    # Through ncf-main's own flag parsing and the ml-1m preset (which a baseline tree
    # applies), which turns XLA on for the flags left unset: a row without XLA in its
    # name must run without it.
    for name, extra in throughput.THROUGHPUT_ROWS:
        throughput_flags = experiments.as_arguments(experiments.EXPERIMENTS["throughput"].values)
        config = _ncf_config(["--config=ml1m_tuned", *throughput_flags, *extra])
        xla = "XLA" in name
        assert (config.enable_xla, config.batches_per_step) == (xla, 8 if xla else 1), name
        assert (config.model.dtype == "bf16") == ("bf16" in name), name


def test_repeated_throughput_runs_take_turns():
    # A slow spell of the machine (here the third and fourth calls) falls on both
    # sides when they alternate; in sequence it would fall on one side's runs only.
    calls, speeds = [], iter([10, 10, 4, 4, 10, 10])

    def side(name):
        def run(repeat):
            calls.append((name, repeat))
            return next(speeds)

        return run

    results = throughput.alternated_runs({"ours": side("ours"), "old": side("old")}, 3)
    assert calls == [("ours", 0), ("old", 0), ("ours", 1), ("old", 1), ("ours", 2), ("old", 2)]
    assert results == {"ours": [10, 4, 10], "old": [10, 4, 10]}


def _benchmark_log(path, *runs, summary=None):
    """A benchmark log of ncf-main `runs`: (recorded flags, finished), each finished one
    with `summary`'s entries in its summary record."""
    with open(path, "w") as log:
        for flags, finished in runs:
            log.write(json.dumps({"kind": "run_info", "flags": flags}) + "\n")
            log.write(json.dumps({"kind": "evaluation", "epoch": 0, "hr": 0.5}) + "\n")
            if finished:
                record = {"kind": "summary", "best_hr": 0.5, "total_seconds": 9.5}
                log.write(json.dumps({**record, **(summary or {})}) + "\n")


RECORDED = {
    "dataset": "ncf-ml-1m",
    "learning_rate": 0.008,
    "layers": ["64", "32"],
    "enable_xla": True,
    "clean": True,
    "sparse_embedding_updates": False,
    "seed": 1,
}
# The same values as a command line gives them; the first learning rate is overridden.
FLAGS = ["--dataset=ncf-ml-1m", "--learning_rate=0.001", "--layers=64,32", "--enable_xla"]
FLAGS += ["--clean", "--sparse_embedding_updates=False", "--seed=1", "--learning_rate=0.008"]


def test_resume_reuses_a_finished_run_only_with_the_same_flags(tmp_path):
    log = tmp_path / "benchmark.jsonl"
    _benchmark_log(log, (RECORDED, True))
    assert resume.finished_run(str(log), FLAGS) == {
        "kind": "summary",
        "best_hr": 0.5,
        "total_seconds": 9.5,
    }
    for other in (
        "--seed=2",
        "--noenable_xla",
        "--noclean",
        "--layers=64,16",
        "--learning_rate=0.001",
        "--sparse_embedding_updates=True",
        "--dataset=ml-1m",
        "--num_neg=8",  # a flag the run did not record
    ):
        assert resume.finished_run(str(log), [*FLAGS, other]) is None, other


def test_resume_runs_again_what_did_not_finish(tmp_path):
    log = tmp_path / "benchmark.jsonl"
    assert resume.finished_run(str(log), FLAGS) is None  # never started
    _benchmark_log(log, (RECORDED, False))
    assert resume.finished_run(str(log), FLAGS) is None  # stopped before its summary
    _benchmark_log(log, (RECORDED, True), (RECORDED, False))
    assert resume.finished_run(str(log), FLAGS) is None  # a later run in the log stopped
    _benchmark_log(log, (RECORDED, True))
    with open(log, "a") as cut:
        cut.write('{"kind": "evalua')  # a line cut short by a kill
    assert resume.finished_run(str(log), FLAGS) is None


def test_resume_runs_again_a_run_whose_pretrained_part_was_trained_again(tmp_path):
    part, run = tmp_path / "part", tmp_path / "run"
    os.makedirs(part)
    os.makedirs(run)
    recorded = {**RECORDED, "pretrain_mlp_dir": str(part)}
    flags = [*FLAGS, f"--pretrain_mlp_dir={part}"]
    _benchmark_log(part / "benchmark.jsonl", (RECORDED, True))
    _benchmark_log(run / "benchmark.jsonl", (recorded, True))
    os.utime(part / "benchmark.jsonl", (1000, 1000))
    os.utime(run / "benchmark.jsonl", (2000, 2000))
    assert resume.finished_run(str(run / "benchmark.jsonl"), flags) is not None
    os.utime(part / "benchmark.jsonl", (3000, 3000))  # the part finished again since
    assert resume.finished_run(str(run / "benchmark.jsonl"), flags) is None


def test_resume_runs_only_the_runs_it_cannot_reuse(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(resume, "run_ours", lambda flags, log_path: (ran.append(log_path), 3.0)[1:])
    os.makedirs(tmp_path / "finished")
    recorded = {**RECORDED, "benchmark_log_dir": f"{tmp_path}/finished"}
    _benchmark_log(tmp_path / "finished" / "benchmark.jsonl", (recorded, True))
    work = str(tmp_path)
    resuming, not_resuming = argparse.Namespace(resume=True), argparse.Namespace(resume=False)
    assert resume.run_or_resume(resuming, work, "finished", FLAGS) == 9.5  # its log's seconds
    assert ran == []
    assert resume.run_or_resume(resuming, work, "other", FLAGS) == 3.0
    assert resume.run_or_resume(not_resuming, work, "finished", FLAGS) == 3.0
    assert ran == [f"{work}/other.log", f"{work}/finished.log"]


def test_resume_needs_a_log_dir(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["benchmark_training.py", "--suite=paper", "--resume"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    assert "--resume needs --log_dir" in capsys.readouterr().err


def _flag(flags, name):
    """The value ncf-main takes for --name: its last occurrence, or else the value of
    the --config experiment."""
    given = [flag.partition("=")[2] for flag in flags if flag.startswith(f"--{name}=")]
    if given:
        return given[-1]
    values = experiments.EXPERIMENTS[_flag(flags, "config")].values
    return experiments.as_arguments({name: values[name]})[0].partition("=")[2]


def _fake_runs(monkeypatch, selected_epoch) -> dict:
    """Replaces ncf-main runs with benchmark logs: a validation run of seed s selects
    `selected_epoch`(its name without factors, seed and rate) + s - 1; a test-split run
    has test HR 0.72 + s / 1000 after its last epoch. Returns {run name: its flags}."""
    ran = {}

    def fake_run(args, work, name, flags):
        ran[name] = flags
        seed = int(_flag(flags, "seed"))
        if _flag(flags, "eval_split") == "validation":
            epoch = selected_epoch(name.replace("_sgd0.001", "")) + seed - 1
            summary = {"best_epoch": epoch, "best_hr": 0.73, "test_hr": 0.70, "test_ndcg": 0.40}
        else:
            epochs = int(_flag(flags, "train_epochs"))
            summary = {"epochs": epochs, "eval_split": "test", "best_epoch": epochs - 1}
            summary.update(best_hr=0.72 + seed / 1000, best_ndcg=0.44)
        os.makedirs(f"{work}/{name}", exist_ok=True)
        _benchmark_log(f"{work}/{name}/benchmark.jsonl", ({}, True), summary=summary)
        return 1.0

    monkeypatch.setattr(paper, "run_or_resume", fake_run)
    return ran


def test_refit_trains_the_paper_runs_again_for_their_selected_epochs(
    script, tmp_path, monkeypatch, capsys
):
    ran = _fake_runs(monkeypatch, lambda name: 2)
    argv = ["benchmark_training.py", "--suite=paper", "--ncf_dir=/data/ncf", "--refit"]
    argv += ["--paper_factors=8", "--paper_seed=1", "--paper_seed=3", f"--log_dir={tmp_path}"]
    monkeypatch.setattr("sys.argv", argv)
    script.main()
    assert sorted(ran) == [f"paper8_seed{s}{r}" for s in (1, 3) for r in ("", "_refit")]
    for seed, epochs in ((1, "3"), (3, "5")):
        flags = ran[f"paper8_seed{seed}_refit"]
        assert _flag(flags, "eval_split") == "test"
        assert _flag(flags, "train_epochs") == _flag(flags, "epochs_between_evals") == epochs
    means = [line for line in capsys.readouterr().out.splitlines() if " mean " in line]
    assert [line.split()[3] for line in means] == ["0.7000", "0.7220"]


def test_refit_trains_each_chosen_run_again_on_all_data_for_its_selected_epochs(
    script, tmp_path, monkeypatch, capsys
):
    # Validation selects epoch 5 of the MLP, 40 of MF and 0 of the NeuMF from both
    # (seed 1; seed 2 one epoch later each). The refit runs train 6, 41 and 1 epochs on
    # the test split, the NeuMF from the refit parts, and the mean row reports their
    # test HR, not the validation runs'.
    selected = {"mlp": 5, "mf": 40, "neumf_mf": 0}
    ran = _fake_runs(monkeypatch, lambda name: selected[name.split("_", 2)[2]])
    argv = ["benchmark_training.py", "--suite=pretrained", "--ncf_dir=/data/ncf"]
    argv += ["--paper_factors=64", "--paper_seed=1", "--paper_seed=2"]
    argv += ["--pretrain_gmf_part=mf", "--pretrain_epochs=5", f"--log_dir={tmp_path}", "--refit"]
    monkeypatch.setattr("sys.argv", argv)
    script.main()
    for seed in (1, 2):
        stem = f"pretrained64_seed{seed}"
        for kind, run in (("mlp", "mlp"), ("mf", "mf"), ("neumf_mf", "neumf_mf_sgd0.001")):
            flags = ran[f"{stem}_{run}_refit"]
            epochs = str(selected[kind] + seed)
            assert _flag(flags, "eval_split") == "test"
            assert _flag(flags, "train_epochs") == _flag(flags, "epochs_between_evals") == epochs
            assert _flag(flags, "seed") == str(seed)
        neumf = ran[f"{stem}_neumf_mf_sgd0.001_refit"]
        assert _flag(neumf, "pretrain_gmf_dir") == f"{tmp_path}/{stem}_mf_refit"
        assert _flag(neumf, "pretrain_mlp_dir") == f"{tmp_path}/{stem}_mlp_refit"
        assert _flag(ran[f"{stem}_mf_refit"], "model") == "mf"
    means = [line for line in capsys.readouterr().out.splitlines() if " mean " in line]
    assert [line.split()[5] for line in means] == ["0.7000", "0.7215"]


def test_an_ncf_dir_not_named_ncf_is_refused_before_any_run(script, monkeypatch, capsys):
    # The split is read from DATA_DIR/ncf: another name would read a sibling folder.
    ran = _fake_runs(monkeypatch, lambda name: 2)
    argv = ["benchmark_training.py", "--suite=paper", "--ncf_dir=/data/ncf-split"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as stopped:
        script.main()
    assert stopped.value.code == 2 and not ran
    assert "error: --ncf_dir /data/ncf-split must be a folder named ncf" in capsys.readouterr().err
