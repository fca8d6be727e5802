"""scripts/plots.py and the training suites' figures (scripts/training_benchmarks/plots.py):
whole PNGs of the size asked for, written atomically, one clear error without matplotlib,
and each suite's --plot_dir figure drawn from what its runs logged."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
from conftest import SCRIPTS_DIR, load_script

sys.path.insert(0, SCRIPTS_DIR)  # as `python scripts/...` has it
import plots  # noqa: E402
from training_benchmarks import plots as training_plots  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PIXELS = (840, 504)  # plots.SIZE_INCHES x plots.DPI, as (width, height)


def _check_png(path) -> None:
    """`path` is a PNG that matplotlib reads back at `PIXELS`."""
    from matplotlib import image

    with open(path, "rb") as png:
        assert png.read(8) == PNG_SIGNATURE
    height, width = image.imread(path).shape[:2]
    assert (width, height) == PIXELS


def test_a_line_chart_is_a_png_of_the_size_asked_for_and_nothing_else_is_left(tmp_path, capsys):
    path = str(tmp_path / "figures" / "lines.png")  # the folder is made
    series = {"lru": ([2**16, 2**20], [1.5, 2.0]), "lfu": ([2**16, 2**20], [1.7, 2.1])}
    written = plots.line_chart(
        path, "t", "capacity (rows)", "ms", series, "cpu: x", log_x=True, threshold=("2 s", 2.0)
    )
    assert written == path
    _check_png(path)
    assert os.listdir(tmp_path / "figures") == ["lines.png"]
    assert capsys.readouterr().out == f"figure: {path}\n"


def test_a_bar_chart_is_a_png_of_the_size_asked_for(tmp_path):
    path = str(tmp_path / "bars.png")
    plots.bar_chart(path, "t", "examples/s", {"fp32": 200_000.0, "bf16": 150_000.0}, "cpu: x")
    _check_png(path)


def test_a_figure_replaces_the_one_before(tmp_path):
    path = tmp_path / "bars.png"
    path.write_bytes(b"the previous figure")
    plots.bar_chart(str(path), "t", "y", {"a": 1.0}, "cpu: x")
    _check_png(path)
    assert os.listdir(tmp_path) == ["bars.png"]


def test_a_figure_that_fails_to_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "lines.png"
    path.write_bytes(b"the previous figure")
    from matplotlib.figure import Figure

    def broken_save(self, fname, *args, **kwargs):
        with open(fname, "wb") as partial:
            partial.write(b"\x89PNG")  # cut short
        raise OSError("No space left on device")

    monkeypatch.setattr(Figure, "savefig", broken_save)
    with pytest.raises(OSError, match="No space left"):
        plots.line_chart(str(path), "t", "x", "y", {"a": ([1], [1])}, "cpu: x")
    assert path.read_bytes() == b"the previous figure"
    assert os.listdir(tmp_path) == ["lines.png"]


@pytest.mark.parametrize("draw", ["require", "line_chart", "bar_chart"])
def test_without_matplotlib_a_figure_is_one_error_naming_the_extra(monkeypatch, tmp_path, draw):
    # What an environment without the extra sees: every matplotlib import fails
    # (submodules imported before included: an import finds those in sys.modules).
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    calls = {
        "require": lambda: plots.require(str(tmp_path)),
        "line_chart": lambda: plots.line_chart(
            str(tmp_path / "l.png"), "t", "x", "y", {"a": ([1], [1])}, "cpu: x"
        ),
        "bar_chart": lambda: plots.bar_chart(str(tmp_path / "b.png"), "t", "y", {"a": 1}, "x"),
    }
    with pytest.raises(SystemExit) as exit_info:
        calls[draw]()
    assert str(exit_info.value) == (
        "error: --plot_dir needs matplotlib: pip install -e '.[benchmark]'"
    )
    assert not os.listdir(tmp_path)


def test_a_cloud_storage_plot_dir_is_refused():
    with pytest.raises(SystemExit, match="error: --plot_dir must be a local folder"):
        plots.require("gs://bucket/figures")


def _benchmark_log(work, name: str, rates: list[float]) -> None:
    """An ncf-main benchmark log of a run named `name` whose epochs scored `rates`."""
    os.makedirs(work / name)
    records = [{"kind": "run_info", "flags": {}}]
    records += [{"kind": "evaluation", "epoch": e, "hr": hr} for e, hr in enumerate(rates)]
    records.append({"kind": "summary", "best_hr": max(rates)})
    (work / name / "benchmark.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def drawn(monkeypatch):
    """The series each figure of the training suites draws (the figure is still written),
    under a machine line that asks no TensorFlow process."""
    series, draw = {}, plots.line_chart

    def line_chart(path, title, x_label, y_label, curves, *args, **kwargs):
        series[os.path.basename(path)] = {k: (list(x), list(y)) for k, (x, y) in curves.items()}
        return draw(path, title, x_label, y_label, curves, *args, **kwargs)

    monkeypatch.setattr(training_plots.figures, "line_chart", line_chart)
    monkeypatch.setattr(training_plots, "machine_line", lambda peer: "cpu: x; 2 cores")
    return series


def test_the_convergence_suite_draws_each_seeds_hr_after_each_epoch(tmp_path, drawn):
    # Seed 1 reaches the target after its second epoch, seed 2 never does.
    _benchmark_log(tmp_path, "convergence_seed1", [0.20, 0.24])
    _benchmark_log(tmp_path, "convergence_seed2", [0.19, 0.21, 0.22])
    args = argparse.Namespace(
        plot_dir=str(tmp_path / "figures"), convergence_seeds=2, convergence_target=0.23
    )
    path = training_plots.convergence_figure(args, str(tmp_path))
    assert path == str(tmp_path / "figures" / "convergence.png")
    _check_png(path)
    assert drawn["convergence.png"] == {
        "seed 1": ([1, 2], [0.20, 0.24]),
        "seed 2": ([1, 2, 3], [0.19, 0.21, 0.22]),
    }


def test_the_paper_suite_draws_the_mean_validation_hr_of_each_size_by_epoch(tmp_path, drawn):
    _benchmark_log(tmp_path, "paper8_seed1", [0.60, 0.70])
    _benchmark_log(tmp_path, "paper8_seed2", [0.62, 0.68, 0.69])  # a longer run
    _benchmark_log(tmp_path, "paper8_seed1_refit", [0.1])  # not a selected run: not drawn
    args = argparse.Namespace(plot_dir=str(tmp_path), paper_factors=[8], paper_seed=[1, 2])
    path = training_plots.paper_figure(args, str(tmp_path))
    _check_png(path)
    assert os.path.basename(path) == "paper_hr_per_epoch.png"
    ((label, (epochs, means)),) = drawn["paper_hr_per_epoch.png"].items()
    assert label == "factors 8 (mean of 2 seeds)" and epochs == [0, 1, 2]
    assert means == pytest.approx([0.61, 0.69, 0.69])


def test_a_paper_line_of_one_seed_is_labelled_by_its_seed(tmp_path, drawn):
    _benchmark_log(tmp_path, "paper16_seed3", [0.65, 0.70])
    args = argparse.Namespace(plot_dir=str(tmp_path), paper_factors=[16], paper_seed=[3])
    training_plots.paper_figure(args, str(tmp_path))
    assert drawn["paper_hr_per_epoch.png"] == {"factors 16 (seed 3)": ([0, 1], [0.65, 0.70])}


def test_the_throughput_suite_draws_a_bar_per_row(tmp_path, monkeypatch):
    monkeypatch.setattr(training_plots, "machine_line", lambda peer: f"cpu: x; peer {peer}")
    bars, draw = {}, plots.bar_chart

    def bar_chart(path, title, x_label, values, caption):
        bars.update(values=values, caption=caption, x_label=x_label)
        return draw(path, title, x_label, values, caption)

    monkeypatch.setattr(training_plots.figures, "bar_chart", bar_chart)
    rows = [
        ("ours (fp32)", 516_344.0, 152),
        ("Model Garden NCF (TF 2.15, Keras fit)", 280_226.0, 1000),
    ]
    args = argparse.Namespace(plot_dir=str(tmp_path), peer="peer.sh", throughput_repeats=2)
    _check_png(training_plots.throughput_figure(args, rows))
    assert bars == {
        "values": {"ours (fp32)": 516_344.0, "Model Garden NCF (TF 2.15, Keras fit)": 280_226.0},
        "caption": "cpu: x; peer peer.sh",
        "x_label": "training examples/s (best of 2 runs per row)",
    }


def test_without_plot_dir_the_suites_draw_nothing(tmp_path):
    args = argparse.Namespace(plot_dir=None)
    assert training_plots.convergence_figure(args, str(tmp_path)) is None
    assert training_plots.paper_figure(args, str(tmp_path)) is None
    assert training_plots.throughput_figure(args, []) is None
    assert not os.listdir(tmp_path)


def test_the_convergence_suite_draws_its_figure_at_its_end(tmp_path, monkeypatch, drawn):
    from training_benchmarks import convergence

    def run(args, work, name, flags):  # a run: its benchmark log, 1 s
        _benchmark_log(tmp_path, name, [0.20, 0.24])
        return 1.0

    monkeypatch.setattr(convergence, "run_or_resume", run)
    monkeypatch.setattr(convergence, "ml1m_data_dir", lambda ratings, work, name: "/data")
    monkeypatch.setitem(sys.modules, "mlperf_score", argparse.Namespace(main=lambda argv: 0))
    args = argparse.Namespace(
        ratings=None, convergence_target=0.23, convergence_seeds=1, plot_dir=str(tmp_path)
    )
    convergence.convergence(args, str(tmp_path))
    _check_png(tmp_path / "convergence.png")
    assert drawn["convergence.png"] == {"seed 1": ([1, 2], [0.20, 0.24])}


def test_benchmark_training_stops_before_its_runs_without_matplotlib(monkeypatch, tmp_path):
    script = load_script("benchmark_training")
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(script, "throughput", lambda args, work: pytest.fail("a suite ran"))
    argv = ["benchmark_training.py", "--suite", "throughput", "--plot_dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[benchmark\]'"):
        script.main()
