"""The online baseline ladder's popularity rungs (scripts/peers/popularity_online.py):
hand-computed weights on a hand-built stream, the same weights as an event-by-event
loop whatever the chunking, and the same protocol numbers at any chunk size."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from conftest import SCRIPTS_DIR

from recommendation.online import prequential

sys.path.insert(0, os.path.join(SCRIPTS_DIR, "peers"))  # as `python scripts/peers/...` has it
import peer_harness  # noqa: E402
import popularity_online  # noqa: E402


def _plan(positions, candidates) -> prequential.Plan:
    candidates = np.asarray(candidates, np.int64).reshape(len(positions), -1)
    positions = np.asarray(positions, np.int64)
    return prequential.Plan(
        positions=positions,
        users=np.zeros(len(positions), np.int64),
        items=candidates[:, 0],
        candidates=candidates,
        valid=np.ones((len(positions), candidates.shape[1] - 1), bool),
        cold=np.zeros(len(positions), bool),
        ordinals=positions,
    )


@pytest.mark.parametrize(
    "half_life, first, second",
    [
        (None, [[2, 1, 0], [1, 3, 1]], [[2, 3, 2]]),
        # 2 ** -(events since): item 10 at position 3 has had events 3 and 1 back.
        (
            1,
            [[2**-3 + 2**-1, 2**-2, 0], [2**-4, 2**-5 + 2**-3 + 2**-2, 2**-1]],
            [[2**-3 + 2**-1, 2**-7 + 2**-5 + 2**-4, 2**-6 + 2**-2]],
        ),
    ],
)
def test_the_weights_are_the_hand_computed_ones(half_life, first, second):
    """Items 10, 20, 10, 10, 30, 20 then 30, 10; scored at positions 3 and 5 of the
    first chunk (events before them in it count) and 1 of the second."""
    learner = popularity_online.ItemPopularity(half_life)
    scores = learner.test_then_add(
        _plan([3, 5], [[10, 20, 30], [20, 10, 30]]), np.array([10, 20, 10, 10, 30, 20])
    )
    np.testing.assert_allclose(scores, first, rtol=1e-12)
    scores = learner.test_then_add(_plan([1], [[30, 10, 20]]), np.array([30, 10]))
    np.testing.assert_allclose(scores, second, rtol=1e-12)
    assert learner.tables()["item"]["ids"] == 3


def _event_by_event(items: np.ndarray, candidates: np.ndarray, half_life) -> np.ndarray:
    """Each event's candidates' weights by a plain loop over the stream."""
    weights: dict[int, float] = {}
    decay = 1.0 if half_life is None else 2 ** (-1 / half_life)
    scores = np.zeros(candidates.shape)
    for index, item in enumerate(items.tolist()):
        scores[index] = [weights.get(candidate, 0.0) for candidate in candidates[index].tolist()]
        weights = {key: value * decay for key, value in weights.items()}
        weights[item] = weights.get(item, 0.0) + decay
    return scores


@pytest.mark.parametrize("half_life", [None, 3.0, 50.0])
@pytest.mark.parametrize("chunk", [1, 7, 64, 600])
def test_any_chunking_gives_the_event_by_event_weights(half_life, chunk):
    random = np.random.default_rng(2)
    items = 100 + np.minimum(random.geometric(0.2, 600), 30)
    candidates = np.concatenate([items[:, None], random.integers(95, 135, (600, 5))], axis=1)
    expected = _event_by_event(items, candidates, half_life)
    learner = popularity_online.ItemPopularity(half_life)
    found = np.concatenate(
        [
            learner.test_then_add(
                _plan(np.arange(min(chunk, 600 - begin)), candidates[begin : begin + chunk]),
                items[begin : begin + chunk],
            )
            for begin in range(0, 600, chunk)
        ]
    )
    if half_life is None:
        np.testing.assert_array_equal(found, expected)
    else:
        np.testing.assert_allclose(found, expected, rtol=1e-9, atol=1e-300)


class _EventByEvent:
    """The same weights as a plain `peer_harness.Learner`, right at one event a chunk."""

    def __init__(self, half_life: float) -> None:
        self.weights: dict[int, float] = {}
        self.decay = 2 ** (-1 / half_life)

    def score(self, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return np.vectorize(lambda item: self.weights.get(item, 0.0))(candidates)

    def learn(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> None:
        for item in items[labels == 1].tolist():
            self.weights = {key: value * self.decay for key, value in self.weights.items()}
            self.weights[item] = self.weights.get(item, 0.0) + self.decay

    def tables(self) -> dict[str, dict]:
        return {"user": {"ids": 0}, "item": {"ids": len(self.weights)}}


def test_the_chunk_size_changes_nothing_but_the_speed(tmp_path):
    """The protocol's numbers are an event-by-event learner's at any chunk size."""
    random = np.random.default_rng(4)
    count = 3000
    events = np.stack(
        [
            random.integers(1, 50, count),
            100 + np.minimum(random.geometric(0.1, count), 60),
            1000 + np.arange(count),
        ],
        axis=1,
    )
    os.makedirs(tmp_path / "events")
    with open(tmp_path / "events" / "a.csv", "w") as out:
        out.writelines(f"{u},{i},{t}\n" for u, i, t in events)
    reference = prequential.Prequential()
    peer_harness.run(
        peer_harness.EventFolder(str(tmp_path / "events")).chunks(1), _EventByEvent(200), reference
    )
    expected = reference.results()
    assert expected["all"]["scored"] > 300 and expected["all"]["hr"] > 0.3  # random: 0.1
    for chunk in (1, 300, 4096):
        flags = [
            f"--events_dir={tmp_path / 'events'}",
            f"--chunk_events={chunk}",
            "--half_life_events=200",
        ]
        result = popularity_online.main(flags)
        assert result["peer"]["model"] == "recent popularity (half-life 200 events)"
        for cohort in ("all", "cold", "warm"):
            for name, value in expected[cohort].items():
                assert result["prequential"][cohort][name] == pytest.approx(value, rel=1e-9)
