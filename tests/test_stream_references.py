"""A generated stream's two reference scores: the protocol's own events and
candidates, each candidate's true popularity rank at the event's second, the oracle
above popularity above chance where taste is strong."""

from __future__ import annotations

import dataclasses

import numpy as np

from recommendation.data import event_stream_data, stream_references
from recommendation.data.event_stream_data import EventStreamSpec
from recommendation.online.prequential import Prequential

TASTY = EventStreamSpec(num_users=1500, num_items=400, num_events=40_000, candidates=32)


def test_log_popularity_is_the_power_law_mass_of_each_rank():
    ranks = np.array([0, 1, 2])
    for exponent, masses in [(1.0, np.log([2.0, 1.5, 4 / 3])), (2.0, [1 / 2, 1 / 6, 1 / 12])]:
        spec = dataclasses.replace(TASTY, popularity_exponent=exponent)
        logs = stream_references.log_popularity(spec, ranks)
        # Up to the common normaliser: the differences are exact.
        np.testing.assert_allclose(np.diff(logs), np.diff(np.log(masses)), rtol=1e-12)


def test_ranks_are_the_generators_drifted_ranks():
    """The item the generator takes for rank r at second t is ranked r at t."""
    spec = dataclasses.replace(TASTY, popularity_drift=0.5)
    model = event_stream_data.plant(spec, seed=4)
    scorer = stream_references.ReferenceScorer(spec, model)
    seconds = spec.duration_seconds
    times = spec.start_timestamp + np.array([0, seconds // 3, seconds - 1])
    ranks = np.array([[0, 7, 399], [0, 7, 399], [0, 7, 399]])
    fallen = np.floor((times - spec.start_timestamp) / seconds * 0.5 * 400)
    rows = model.rank_items[(ranks - fallen.astype(np.int64)[:, None]) % 400]
    items = model.planted.item_ids[rows]
    np.testing.assert_array_equal(scorer.ranks(scorer.item_rows(items), times), ranks)
    np.testing.assert_array_equal(scorer.item_rows(items), rows)
    assert fallen.tolist() == [0, 66, 199]  # the drift moved them


def test_the_references_score_the_trainers_events_and_candidates(tmp_path):
    """Read back from the files in chunks of another size, the events give the same
    plans: the same protocol tallies to the bit, with the trainer's defaults."""
    paths = event_stream_data.write_event_files(TASTY, 3, str(tmp_path), num_files=2)
    written = stream_references.reference_scores(TASTY, 3)
    rows = np.concatenate([np.loadtxt(p, np.int64, delimiter=",", skiprows=1) for p in paths])
    scorer = stream_references.ReferenceScorer(TASTY, event_stream_data.plant(TASTY, 3))
    again = Prequential()
    for start in range(0, len(rows), 997):
        users, items, times = rows[start : start + 997].T
        plan = again.plan(users, items, times)
        users = plan.users
        again.record(plan, scorer.scores(users, plan.candidates, times[plan.positions])[0])
    result = {key: value for key, value in again.results().items() if key != "windows"}
    assert result == written["popularity"]
    assert result["every"] == 8 and result["negatives"] == 99  # ncf-online's defaults
    assert written["oracle"]["all"]["scored"] == result["all"]["scored"] > 4000


def test_the_oracle_beats_popularity_which_beats_chance():
    scores = stream_references.reference_scores(TASTY, 5)
    model = event_stream_data.plant(TASTY, 5)
    chance = Prequential()
    rng = np.random.default_rng(0)
    for block in event_stream_data.iter_events(TASTY, 5, model):
        plan = chance.plan(block.users, block.items, block.timestamps)
        chance.record(plan, rng.random(plan.candidates.shape))
    hr = {name: result["all"]["hr"] for name, result in scores.items()}
    assert chance.results()["all"]["hr"] + 0.2 < hr["popularity"] < hr["oracle"] - 0.05
    assert scores["oracle"]["warm"]["hr"] > scores["popularity"]["warm"]["hr"] + 0.05
    # Without taste the oracle is popularity.
    plain = stream_references.reference_scores(dataclasses.replace(TASTY, candidates=1), 5)
    assert plain["oracle"] == plain["popularity"]
