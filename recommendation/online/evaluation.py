"""Test, then train: the prequential protocol (`prequential`) run on a RecModel as a
callback, each step's events scored by the model as it is before the step trains."""

from __future__ import annotations

import numpy as np
import pandas as pd
import tensorflow as tf
from absl import logging

from recommendation.data import constants
from recommendation.online import prequential
from recommendation.online.callback_base import Callback


class PrequentialEvaluation(Callback):
    """Test, then train, by one protocol for every system (`prequential`): each step's
    chosen events are scored against their candidates with the model as it is before
    the step trains (`OnlineNeuMF.score_candidates`, this callback's ``probe``, run in
    the sink's graph call right before the step), whatever the sink's size (on a
    cluster, every step of a sink before the sink: `sink_calls.probe_call`).

    Which events, against which candidates, follows from the stream alone: that is
    planned as each sink is read (`on_sink_read`, on the reading thread with boost
    O1+), each step's distinct candidates once; the scores are tallied once the sink is
    done.

    Args:
        protocol: The protocol's state over this stream.
    """

    def __init__(self, protocol: prequential.Prequential) -> None:
        super().__init__()
        self.protocol = protocol
        self.events = 0  # of the sinks scored (the protocol has planned those read)
        self.last_window: dict | None = None  # the newest window closed

    def on_sink_read(self, group) -> None:
        stacked = group.stacked
        times = stacked.get(constants.TIME_COLUMN)
        plans, items, positions = [], [], []
        for step in range(group.num_steps):
            users = np.ravel(stacked[constants.USER_COLUMN][step])
            step_items = np.ravel(stacked[constants.ITEM_COLUMN][step])
            when = np.zeros_like(users) if times is None else np.ravel(times[step])
            plan = self.protocol.plan(users, step_items, when)
            # Each distinct candidate of a step looked up and projected once (found by
            # a hash table: a sort of every candidate cost more).
            found, distinct = pd.factorize(plan.candidates.ravel())
            plans.append(plan)
            items.append(distinct.astype(np.int64))
            positions.append(found.astype(np.int32).reshape(plan.candidates.shape))
        group.notes[self] = plans
        group.probe_inputs[self] = (
            np.concatenate([plan.users for plan in plans]),
            np.concatenate(items),
            np.concatenate(positions),
            _starts([plan.size for plan in plans]),
            _starts([len(distinct) for distinct in items]),
        )

    def probe(self, inputs: tuple, step: tf.Tensor) -> tf.Tensor:
        """The scores of step `step`'s planned events' candidates (in the sink's graph
        call, before the step trains)."""
        users, items, positions, event_starts, item_starts = inputs
        events = slice(event_starts[step], event_starts[step + 1])
        distinct = slice(item_starts[step], item_starts[step + 1])
        return self.rec_model.network.score_candidates(
            users[events], items[distinct], positions[events]
        )

    def on_sink_end(self, group) -> None:
        self.events += group.num_events
        scores, start = group.probe_outputs[self], 0
        for plan in group.notes[self]:
            self.protocol.record(plan, scores[start : start + plan.size])
            start += plan.size
        # Each window of the curve said as it closes (the summary keeps a bounded curve).
        after = 0 if self.last_window is None else self.last_window["end"]
        for window in self.protocol.closed_windows(after, self.events):
            self.last_window = window
            if window["scored"]:
                logging.info(
                    "prequential, events %s to %s: HR@%d=%.4f NDCG=%.4f (%s scored)",
                    f"{window['start']:,}",
                    f"{window['end']:,}",
                    self.protocol.top_k,
                    window["hr"],
                    window["ndcg"],
                    f"{window['scored']:,}",
                )

    def results(self) -> dict:
        """The protocol's numbers (`prequential.Prequential.results`) over the sinks
        scored: the events of sinks read ahead but not trained are not counted."""
        return {**self.protocol.results(), "events": self.events}

    def gauges(self) -> dict[str, float]:
        """The protocol's numbers over the stream so far, for a metric report:
        ``prequential_hr``, ``..._ndcg``, ``..._auc``, ``..._hr_cold``, ``..._hr_warm``
        (those scored yet), and ``..._hr_window``, the newest closed window's (the curve
        on TensorBoard)."""
        results = self.protocol.results()
        values = {f"prequential_{key}": results["all"][key] for key in ("hr", "ndcg", "auc")}
        values.update(
            prequential_hr_cold=results["cold"]["hr"], prequential_hr_warm=results["warm"]["hr"]
        )
        if self.last_window is not None and self.last_window["hr"] is not None:
            values["prequential_hr_window"] = self.last_window["hr"]  # a point a window
        return {key: value for key, value in values.items() if value is not None}


def _starts(sizes: list[int]) -> np.ndarray:
    """Where each of consecutive parts of `sizes` starts, and the end (int32)."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
