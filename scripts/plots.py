"""Figures for the results page (docs/benchmarks.md), drawn by the benchmark scripts
given ``--plot_dir DIR``: a curve where it says more than a table.

Two kinds: `line_chart` (a line per series, log-2 x for capacities) and `bar_chart` (a
bar per row). Each figure has a title, labelled axes and the machine line as a caption,
and is written to a temporary name in its folder, then renamed over ``DIR/<name>.png``:
a figure is whole or absent. The folder is local (matplotlib writes files, not
``gs://`` objects).

matplotlib is the ``benchmark`` extra (``pip install -e '.[benchmark]'``), imported
only when a figure is asked for; a script calls `require` when it reads --plot_dir, so
that a missing extra stops it before it measures, not after. Figures are drawn with
the Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

INSTALL_HINT = "pip install -e '.[benchmark]'"
SIZE_INCHES, DPI = (7.0, 4.2), 120  # 840 x 504 pixels


def require(plot_dir: str) -> None:
    """Exits with one line unless figures can be written to `plot_dir`: matplotlib is
    installed and the folder is local."""
    if "://" in plot_dir:
        raise SystemExit(f"error: --plot_dir must be a local folder, not {plot_dir}")
    _figure()


def line_chart(
    path: str,
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    caption: str,
    log_x: bool = False,
    threshold: tuple[str, float] | None = None,
    y_from_zero: bool = False,
) -> str:
    """Writes a line per entry of `series` (``label: (xs, ys)``) to `path`, with a
    dashed horizontal `threshold` (``(label, y)``) if given and `caption` under the
    axes; `log_x`: a log-2 x axis; `y_from_zero`: the y axis starts at 0 (a cost whose
    flatness is the point). Returns `path`."""
    figure = _figure()
    axes = figure.subplots()
    for label, (xs, ys) in series.items():
        axes.plot(list(xs), list(ys), marker="o", markersize=3, label=label)
    if threshold is not None:
        axes.axhline(threshold[1], linestyle="--", color="gray", label=threshold[0])
    if log_x:
        axes.set_xscale("log", base=2)
    elif all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        axes.xaxis.set_major_locator(_ticker().MaxNLocator(integer=True))  # epochs: 1, 2, ...
    if y_from_zero:
        top = max([y for _, ys in series.values() for y in ys] + [threshold[1] if threshold else 0])
        axes.set_ylim(0, 1.08 * top or 1)  # the highest point whole
    axes.legend(fontsize="small")
    return _write(figure, axes, path, title, x_label, y_label, caption)


def bar_chart(
    path: str,
    title: str,
    x_label: str,
    bars: Mapping[str, float],
    caption: str,
    value_format: str = "{x:,.0f}",
) -> str:
    """Writes a horizontal bar per entry of `bars` (``label: value``, top to bottom),
    each with its value (`value_format`) at its end, to `path`. Returns `path`."""
    figure = _figure()
    axes = figure.subplots()
    labels, values = list(bars), list(bars.values())
    drawn = axes.barh(range(len(bars)), values)
    labels_at_ends = [value_format.format(x=value) for value in values]
    axes.bar_label(drawn, labels_at_ends, padding=3, fontsize="small")
    axes.set_yticks(range(len(bars)), labels, fontsize="small")
    axes.invert_yaxis()  # the first row on top, as in the table
    axes.margins(x=0.15)  # room for the values
    axes.xaxis.set_major_locator(_ticker().MaxNLocator(5))
    axes.xaxis.set_major_formatter(_ticker().StrMethodFormatter(value_format))
    return _write(figure, axes, path, title, x_label, "", caption)


def _write(figure, axes, path, title, x_label, y_label, caption) -> str:
    """Titles, labels and caption; `figure` written to `path` through a temporary file
    in the same folder. Prints the path."""
    figure.suptitle(title, fontsize="medium")  # over the figure: long bar labels shift the axes
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    figure.text(0.01, 0.01, caption, fontsize=6, color="dimgray", wrap=True)
    figure.tight_layout(rect=(0, 0.06, 1, 1))  # the caption's strip at the bottom
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        figure.savefig(temporary, format="png", dpi=DPI)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    print(f"figure: {path}", flush=True)
    return path


def _ticker():
    """matplotlib.ticker (imported once `_figure` has checked matplotlib is there)."""
    from matplotlib import ticker

    return ticker


def _figure():
    """An empty figure on matplotlib's Agg canvas, or the exit that names the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit(f"error: --plot_dir needs matplotlib: {INSTALL_HINT}") from None
    figure = Figure(figsize=SIZE_INCHES)
    FigureCanvasAgg(figure)
    return figure
