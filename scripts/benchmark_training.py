"""Training benchmark: this project against the TensorFlow Model Garden NCF, one run.

Suites (each prints a table; both systems run on this machine, in this run):

- ``throughput``: training examples/s at the MLPerf model size (factors 64, layers
  256-256-128-64, batch 65536) on synthetic batches over about as many steps as the
  peer's (first calls included on both sides), ours in fp32 and bf16 with and without
  XLA vs the peer; FLOP/s as the reference counts them and as our graph executes them,
  against matmul ceilings measured in the run; each graph's matrix products timed one
  by one in the run, so that each row's step splits into products and the rest, and
  the most that a step of nothing but our products could reach against the peer.
- ``time_to_target``: wall time from a cold start (preprocessing included) to HR@10
  >= --target on ML-1M (999 evaluation negatives), ours vs the peer; also the time our
  trainer waited for data after the first cycle, as a share of its step time.
- ``convergence``: MLPerf-style runs of the ML-1M defaults over seeds, each stopping at
  HR@10 >= --convergence_target, with compliance logs scored by mlperf_score.py.
- ``paper``: the NCF paper protocol (``ncf-ml-1m`` split, 99 fixed negatives) at
  factors 8, 16, 32 and 64 over seeds, the epoch selected on a validation holdout and
  the test holdout reported once, beside the paper's Table 2 (NeuMF without
  pre-training): mean and standard deviation over the seeds.
- ``pretrained``: the same protocol for the paper's pre-trained NeuMF: a GMF (or MF)
  and an MLP model trained alone, then NeuMF started from both and fine-tuned with SGD,
  each selected on validation, beside Table 2's pre-trained row.

- ``baselines``: ItemPop, ItemKNN, EASE and iALS (the ``implicit`` library), each
  tuned on validation within --baseline_budget random configurations and tested once,
  Rendle et al.'s MF (ncf-main ``--model mf`` at each --mf_factors) and the pretrained
  suite's NeuMF, every model scored by the same sampled and full-catalogue evaluation;
  then NeuMF against each model user by user (paired bootstrap interval, McNemar's
  test). On the NCF split beside Dacrema et al.'s and Rendle et al.'s numbers, or on a
  MovieLens release with the MLPerf protocol (--baselines_dataset, --data_dir).

With ``--refit`` the paper and pretrained suites also train each reported configuration
again on all training data, the validation items back in (the paper trained on them),
for the epochs that validation selected, and report that model's test HR once.

    python scripts/benchmark_training.py --suite throughput --suite time_to_target \
        --ratings ../shared/data/ml-1m/ratings.dat --peer ../shared/peer/ncf_official.sh
    python scripts/benchmark_training.py --suite paper --suite pretrained \
        --ncf_dir ../shared/data/ncf --log_dir /tmp/paper
    python scripts/benchmark_training.py --suite pretrained --suite baselines \
        --ncf_dir ../shared/data/ncf --paper_factors 64 --pretrain_gmf_part mf \
        --log_dir /tmp/ladder --resume --plot_dir docs/images

The paper, pretrained and convergence suites train for hours; stopped part way, the
same command with ``--resume`` goes on from the runs that --log_dir holds finished.

This script parses the flags and runs the suites; each suite is a module of
``scripts/training_benchmarks/``, over the runs and logs of its ``harness``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import plots
from training_benchmarks.baselines import baselines
from training_benchmarks.convergence import convergence
from training_benchmarks.harness import peer_process
from training_benchmarks.paper import PAPER_TABLE2, PAPER_TOWER_DEPTHS, paper
from training_benchmarks.pretrained import pretrained
from training_benchmarks.throughput import THROUGHPUT_EPOCHS, throughput
from training_benchmarks.time_to_target import time_to_target

from recommendation.baselines import search
from recommendation.data import movielens
from recommendation.training import experiments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--suite",
        action="append",
        required=True,
        choices=["throughput", "time_to_target", "paper", "pretrained", "convergence", "baselines"],
    )
    parser.add_argument("--ratings", help="ML-1M ratings.dat")
    parser.add_argument("--ncf_dir", help="folder holding ml-1m.train.rating etc.")
    parser.add_argument("--peer", help="path of ../shared/peer/ncf_official.sh")
    parser.add_argument("--peer_data", default="/tmp/peer-data")
    parser.add_argument(
        "--peer_seconds",
        type=float,
        default=240,
        help="how long the peer's throughput run may take",
    )
    parser.add_argument("--target", type=float, default=0.20)
    parser.add_argument(
        "--peer_learning_rate",
        type=float,
        action="append",
        help="learning rate(s) of the peer's time-to-target runs (default 0.001, its tuned "
        "value); each is a separate cold-start run",
    )
    parser.add_argument(
        "--log_dir",
        help="keep every run's log and model here (default: a "
        "temporary folder, deleted at the end)",
    )
    parser.add_argument(
        "--plot_dir",
        help="also draw the results there (matplotlib, the benchmark extra): "
        "throughput.png, convergence.png, paper_hr_per_epoch.png, "
        "baselines_<dataset>.png (default: no figures)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse each training run of the paper, pretrained and convergence suites "
        "that --log_dir holds finished with the same flags (a suite stopped part way "
        "goes on from there); a reused run's seconds are its benchmark log's",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="paper and pretrained suites: also train each reported configuration again "
        "on all training data (the validation items back in, as the paper trained) for "
        "the epochs validation selected, and report its test HR once, at the end",
    )
    parser.add_argument(
        "--throughput_epochs",
        type=int,
        default=THROUGHPUT_EPOCHS,
        help="epochs of synthetic ML-1M steps per throughput row (the default: about as "
        "many steps as the peer's)",
    )
    parser.add_argument(
        "--throughput_repeats",
        type=int,
        default=1,
        help="runs of each throughput row (ours, the baseline tree's, the peer's), taken "
        "in turn; each row reports its best, and every run is printed",
    )
    parser.add_argument(
        "--baseline_tree",
        help="another checkout (an older commit): each throughput row is run there too, "
        "right after ours, and the ratio printed",
    )
    parser.add_argument("--convergence_seeds", type=int, default=10)
    parser.add_argument(
        "--convergence_target", type=float, default=0.23, help="HR@10, 999 negatives"
    )
    protocol = experiments.PAPER_PROTOCOL  # each --paper_* option left unset keeps its value
    parser.add_argument(
        "--paper_epochs", type=int, help=f"default: {protocol['train_epochs']}, the experiment's"
    )
    parser.add_argument(
        "--paper_factors",
        type=int,
        action="append",
        choices=sorted(PAPER_TABLE2),
        help="default: 8, 16, 32 and 64",
    )
    parser.add_argument(
        "--paper_learning_rate",
        type=float,
        help=f"Adam's; default: {protocol['learning_rate']}, the experiment's",
    )
    parser.add_argument(
        "--pretrain_learning_rate",
        type=float,
        action="append",
        help="SGD learning rate(s) of the pre-trained NeuMF (the pretrained suite; "
        "default: 0.001, the paper code's), each fine-tuned from the same GMF and MLP "
        "models; the one with the best mean validation HR@10 is reported",
    )
    parser.add_argument(
        "--pretrain_epochs",
        type=int,
        help="epochs of the pre-trained NeuMF's fine-tuning (default: --paper_epochs)",
    )
    parser.add_argument(
        "--pretrain_gmf_part",
        action="append",
        choices=["gmf", "mf"],
        help="how the pretrained suite trains NeuMF's GMF part (the experiments "
        "ncf_paper_gmf_F and ncf_paper_mf_F; default: both, the one with the best mean "
        "validation HR@10 of its NeuMF is reported)",
    )
    parser.add_argument("--paper_learning_rate_decay", type=float, default=1.0)
    parser.add_argument("--paper_decay_start_epoch", type=int, default=0)
    parser.add_argument(
        "--paper_tower",
        choices=list(PAPER_TOWER_DEPTHS),
        default="code",
        help="MLP tower: the paper's code (4 layers, 8x factors wide), its text (3 layers, "
        "4x) or one layer deeper than the code (5 layers, 16x)",
    )
    parser.add_argument(
        "--paper_weight_decay", type=float, default=0.0, help="decoupled (AdamW) weight decay"
    )
    parser.add_argument(
        "--paper_sparse_updates",
        action="store_true",
        help="update only the embedding rows in each batch (lazy Adam); the default, "
        "dense Adam over whole tables, is what the paper's Keras code did",
    )
    parser.add_argument(
        "--paper_num_neg",
        type=int,
        help=f"training negatives per positive; default: {protocol['num_neg']}, the experiment's",
    )
    parser.add_argument(
        "--paper_embedding_init",
        choices=["glorot_uniform", "normal"],
        help="normal: N(0, 0.01^2) as in the paper's code; default: "
        f"{protocol['embedding_init']}, the experiment's",
    )
    parser.add_argument(
        "--paper_seed", type=int, action="append", help="one run per seed (default: 1, 2, 3)"
    )
    parser.add_argument(
        "--paper_batch_size",
        type=int,
        help="the paper used 256; larger batches keep this CPU run short; default: "
        f"{protocol['batch_size']}, the experiment's",
    )
    parser.add_argument(
        "--baseline",
        action="append",
        choices=list(search.BASELINES),
        help="baselines of the baselines suite (default: all)",
    )
    parser.add_argument(
        "--baseline_budget",
        type=int,
        default=35,
        help="configurations each tunable baseline tries on validation (Dacrema et al. "
        "gave each 35)",
    )
    parser.add_argument(
        "--baseline_search_seed",
        type=int,
        default=1,
        help="seed of the configurations drawn and of the sampled evaluation negatives",
    )
    parser.add_argument(
        "--baselines_dataset",
        default="ncf-ml-1m",
        help="the NCF paper's split (with --ncf_dir), or a MovieLens release under "
        "--data_dir evaluated with the MLPerf protocol (999 sampled negatives)",
    )
    parser.add_argument(
        "--baseline_seed",
        type=int,
        action="append",
        help="seeds a random baseline (iALS, MF) is fitted with for the test (default: 1, 2, 3)",
    )
    parser.add_argument("--data_dir", help="ncf-main --data_dir of --baselines_dataset")
    parser.add_argument(
        "--mf_factors",
        type=int,
        action="append",
        help="dimensions of the baselines suite's MF runs (default: 192, Rendle et al.'s)",
    )
    parser.add_argument("--bootstrap_resamples", type=int, default=10_000)
    args = parser.parse_args()
    if args.resume and not args.log_dir:
        parser.error("--resume needs --log_dir, the folder of the runs to go on from")
    if args.plot_dir:
        plots.require(args.plot_dir)  # before the runs, not after them
    try:
        args.ncf_data_dir = args.ncf_dir and movielens.data_dir_of_ncf_split(args.ncf_dir)
    except movielens.DataError as error:
        parser.error(str(error))
    args.peer_learning_rate = args.peer_learning_rate or [0.001]
    args.paper_factors = args.paper_factors or sorted(PAPER_TABLE2)
    args.paper_seed = args.paper_seed or [1, 2, 3]
    args.pretrain_learning_rate = args.pretrain_learning_rate or [0.001]
    args.pretrain_gmf_part = args.pretrain_gmf_part or ["gmf", "mf"]
    args.baseline = args.baseline or list(search.BASELINES)
    args.baseline_seed = args.baseline_seed or [1, 2, 3]
    args.mf_factors = args.mf_factors or [192]
    if args.peer:
        subprocess.run(["bash", args.peer, "setup"], check=True, **peer_process())
        if args.ratings:
            subprocess.run(
                ["bash", args.peer, "prepare", os.path.abspath(args.ratings), args.peer_data],
                check=True,
                **peer_process(),
            )
    with tempfile.TemporaryDirectory() as temp_dir:
        work = args.log_dir or temp_dir
        os.makedirs(work, exist_ok=True)
        for suite in args.suite:
            suites = {
                "throughput": throughput,
                "time_to_target": time_to_target,
                "paper": paper,
                "pretrained": pretrained,
                "convergence": convergence,
                "baselines": baselines,
            }
            suites[suite](args, work)


if __name__ == "__main__":
    main()
