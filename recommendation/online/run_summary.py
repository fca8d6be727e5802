"""What an ncf-online run reports at its end: the summary's parts drawn from the
callbacks and the model (`outputs`, `rates`, `cluster_counts`) and its one line
(`summary_line`)."""

from __future__ import annotations

import numpy as np

from recommendation.online import callbacks
from recommendation.online.callback_base import Callback
from recommendation.online.evaluation import PrequentialEvaluation
from recommendation.online.rec_model import RecModel
from recommendation.online.state import serving_export


def cluster_counts(rec_model: RecModel) -> dict | None:
    """On a cluster: each table's live rows on each ps task, and the coordinator's
    milliseconds a step resolving, scheduling and waiting for the workers."""
    if rec_model.cluster is None:
        return None
    network = rec_model.network
    return {
        "rows_per_ps": {
            "user": network.user_embedding.rows_per_shard(),
            "item": network.item_embedding.rows_per_shard(),
        },
        "ms_per_step": rec_model.cluster.ms_per_step(),
    }


def outputs(chosen: list[Callback]) -> dict:
    """The summary's tables (`TableWatch.counts`), the prequential protocol's numbers
    (`PrequentialEvaluation.results`; None without one), the count and mean seconds
    and bytes of the full checkpoints and of the deltas (and how long training waited
    for each) and of the exports (None: none made), the publications' count, mean rows
    and seconds, and the side writes that failed."""
    found = {type(callback): callback for callback in chosen}
    export = found.get(serving_export.ExportCallback)
    publisher = export.publisher if export else None
    checkpoint = found[callbacks.CheckpointCallback]
    evaluation = found.get(PrequentialEvaluation)

    def mean(values: list[float]) -> float | None:
        return float(np.mean(values)) if values else None

    return {
        "tables": found[callbacks.TableWatch].counts(),
        "prequential": evaluation.results() if evaluation else None,
        "checkpoints": {
            kind: {
                "count": len(checkpoint.seconds[kind]),
                "seconds": mean(checkpoint.seconds[kind]),
                "bytes": mean(checkpoint.bytes[kind]),
                "wait_seconds": mean(checkpoint.waits[kind]),
            }
            for kind in ("full", "delta")
        },
        "export_seconds": mean(export.seconds) if export else None,
        "export_copy_seconds": mean(export.copy_seconds) if export else None,
        "failed_exports": export.failures.count if export else 0,
        "publications": {
            "count": len(publisher.rows),
            "rows": mean(publisher.rows),
            "seconds": mean(publisher.seconds),
        }
        if publisher
        else None,
        "failed_publications": publisher.failures.count if publisher else 0,
        "failed_tensorboard_writes": found[callbacks.MetricLogger].summaries.failures.count,
    }


def rates(chosen: list[Callback]) -> dict:
    """The metric reports (``history``) and the steady rate at the grain of sinks
    (``steady_events_per_second``: `callbacks.MetricLogger`)."""
    logger = next(c for c in chosen if isinstance(c, callbacks.MetricLogger))
    return {"history": logger.history, "steady_events_per_second": logger.steady_events_per_second}


def summary_line(summary: dict) -> str:
    """The one-line result a user reads at the end."""
    rate = summary["events"] / max(summary["seconds"], 1e-9)
    return (
        f"online: {summary['events']:,} events in {summary['seconds']:.1f} s "
        f"({rate:,.0f} events/s), step {summary['steps']}, {_prequential(summary)}"
        f"dead letters {summary['dead_letters']}, "
        f"{_lost_events(summary)}, {_rewritten_files(summary)}"
        f"reconnects {summary['reconnects']}, {_memory_wait(summary)}"
        f"{_tables_and_failures(summary)}"
        f"{_shards(summary)}"
        f"stopped by {summary['stopped_by']}"
    )


def _prequential(summary: dict) -> str:
    """The protocol's HR over the run, by cohort (`prequential`)."""
    results = summary.get("prequential")
    if results is None or not results["every"]:
        return ""

    def hr(cohort: str) -> str:
        value = results[cohort]["hr"]
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"prequential HR@{results['top_k']}={hr('all')} (cold {hr('cold')}, warm "
        f"{hr('warm')}; {results['all']['scored']:,} scored), "
    )


def _memory_wait(summary: dict) -> str:
    """How long the broker refused writes for memory (Redis at maxmemory), if it did."""
    seconds = summary.get("memory_wait_seconds") or 0.0
    return f"writes refused for memory {seconds:.1f} s, " if seconds else ""


def _lost_events(summary: dict) -> str:
    """The events the source lost; unknown where some may be lost uncounted (never 0
    while acknowledged events may be in no model)."""
    if summary["lost_events_exact"]:
        return f"lost events {summary['lost_events']}"
    return f"lost events unknown ({summary['lost_events']} counted: see the warnings)"


def _rewritten_files(summary: dict) -> str:
    """Event files read again from their start, and rotated by rename (read to their
    end under their new name), for a source of files."""
    count = summary["rewritten_files"]
    if count is None:
        return ""
    return f"rewritten files {count}, rotated files {summary.get('rotated_files', 0)}, "


def _shards(summary: dict) -> str:
    """Rows on each ps task, when trained on a cluster."""
    if not summary.get("cluster"):
        return ""
    rows = summary["cluster"]["rows_per_ps"]
    return "rows per ps task: " + "".join(
        f"{name}s {' / '.join(f'{count:,}' for count in counts)}, " for name, counts in rows.items()
    )


def _tables_and_failures(summary: dict) -> str:
    """How full each table is and what it refused; failed side writes, if any."""
    parts = [
        f"{name}s {t['ids']:,}/{t['capacity']:,} ({t['refused']:,} refused, "
        f"{t['evicted']:,} evicted)"
        for name, t in summary["tables"].items()
    ]
    for key, what in (
        ("failed_exports", "exports"),
        ("failed_publications", "publications"),
        ("failed_tensorboard_writes", "TensorBoard writes"),
    ):
        if summary[key]:
            parts.append(f"{summary[key]:,} {what} failed")
    return "".join(f"{part}, " for part in parts)
