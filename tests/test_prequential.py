"""The prequential protocol every online system is measured by: which events are
scored, against which items, and the numbers, whatever the chunks."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from recommendation.online.prequential import IdCounts, Prequential, event_keys

_MASK = (1 << 64) - 1


def _splitmix(value: int) -> int:
    """SplitMix64's finaliser on a Python int: the protocol's hash as its docs define
    it, written apart from the numpy code that a peer harness imports."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _key(user: int, item: int, time: int, seed: int = 0) -> int:
    key = _splitmix(seed & _MASK)
    for value in (user, item, time):
        key = _splitmix(key ^ (value & _MASK))
    return key


def test_event_keys_are_the_documented_hash():
    users, items, times = [1, 2**62, 0], [10, 3, 0], [-5, 7, 0]
    expected = [_key(u, i, t) for u, i, t in zip(users, items, times, strict=True)]
    assert event_keys(users, items, times).tolist() == expected
    assert event_keys(users, items, times, seed=3).tolist() != expected


def test_a_hand_built_stream_scores_as_computed_by_hand():
    """Every event scored (``every=1``), 2 negatives, HR@1, a user cold for 2 events,
    windows of 3 events; the model scores an item by its id."""
    stream = [(1, 10, 0), (1, 11, 1), (2, 10, 2), (1, 12, 3), (2, 11, 4)]
    protocol = Prequential(every=1, negatives=2, top_k=1, cold_events=2, window_events=3)
    users, items, times = (np.array(column) for column in zip(*stream, strict=True))
    plan = protocol.plan(users, items, times)
    # The first event has nothing seen before it; the others are ranked against items
    # drawn from those seen before them, in first-seen order: [10], [10, 11], ...
    assert plan.positions.tolist() == [1, 2, 3, 4]
    seen_before = [[10], [10, 11], [10, 11], [10, 11, 12]]
    for row, (position, seen) in enumerate(zip(plan.positions, seen_before, strict=True)):
        key = _key(*stream[position])
        drawn = [seen[_splitmix((key + j) & _MASK) % len(seen)] for j in (1, 2)]
        assert plan.candidates[row].tolist() == [stream[position][1], *drawn]
        assert plan.valid[row].tolist() == [d != stream[position][1] for d in drawn]
    assert plan.cold.tolist() == [True, True, False, True]  # (user 1's 3rd is warm)
    protocol.record(plan, plan.candidates.astype(float))
    results = protocol.results()

    def expect(rows):
        """HR@1, NDCG@1 and AUC of `rows` of the plan, by the definitions."""
        hits, auc = [], []
        for row in rows:
            item, drawn = plan.candidates[row][0], plan.candidates[row][1:]
            valid = drawn[plan.valid[row]]
            hits.append(int(np.sum(valid >= item) < 1))
            if len(valid):
                auc.append(np.mean(valid < item))
        hr = np.mean(hits)
        return {"scored": len(rows), "hr": hr, "ndcg": hr, "auc": np.mean(auc)}

    assert results["all"] == pytest.approx(expect([0, 1, 2, 3]))
    assert results["cold"] == pytest.approx(expect([0, 1, 3]))
    assert results["warm"] == pytest.approx(expect([2]))
    # Events 0-2 and 3-4: windows of 3 (the first holds the scored events 1 and 2).
    assert [w["start"] for w in results["windows"]] == [0, 3]
    assert results["windows"][0] == pytest.approx({"start": 0, **expect([0, 1])})
    # Closed once all its events are recorded: the first after 3 events, the second
    # (events 3 to 5) not after the stream's 5.
    assert protocol.closed_windows(0, 2) == []
    assert protocol.closed_windows(0, 5) == [
        pytest.approx({"start": 0, "end": 3, **expect([0, 1])})
    ]
    assert protocol.closed_windows(3, 5) == [] and len(protocol.closed_windows(3, 6)) == 1
    # Event 3 (user 1, item 12) outranks both items seen before it: a hit, AUC 1; an
    # item ranked below one valid negative is no hit at HR@1.
    assert expect([2]) == {"scored": 1, "hr": 1.0, "ndcg": 1.0, "auc": 1.0}


def test_ties_count_against_the_event_and_half_in_auc():
    protocol = Prequential(every=1, negatives=3, top_k=1)
    plan = protocol.plan(np.array([1, 1]), np.array([5, 6]), np.array([0, 1]))
    assert plan.candidates.tolist() == [[6, 5, 5, 5]]  # one item seen before
    protocol.record(plan, np.array([[0.5, 0.5, 0.5, 0.5]]))  # all tied
    assert protocol.results()["all"] == {"scored": 1, "hr": 0.0, "ndcg": 0.0, "auc": 0.5}


def test_the_same_events_are_scored_with_the_same_numbers_whatever_the_chunks():
    """A stream planned whole, in batches of 512 and of 7: the same scored events and
    candidates, and with the same (fixed) scorer the same numbers."""
    rng = np.random.default_rng(0)
    count = 5000
    users = rng.integers(0, 300, count)
    items = rng.zipf(1.5, count) % 400
    times = np.arange(count)

    def run(chunk: int):
        protocol = Prequential(every=8, negatives=9, top_k=3, window_events=1000)
        scored = []
        for start in range(0, count, chunk):
            part = slice(start, start + chunk)
            plan = protocol.plan(users[part], items[part], times[part])
            scores = np.sin(plan.users[:, None] * 0.37 + plan.candidates * 0.11)
            protocol.record(plan, scores)
            scored.append(np.concatenate([plan.ordinals[:, None], plan.candidates], 1))
        return np.concatenate(scored), protocol.results()

    whole, results = run(count)
    # About 1 in 8, by the hash: 601 of 5,000.
    assert len(whole) == 601 and results["all"]["scored"] == 601
    assert results["cold"]["scored"] + results["warm"]["scored"] == 601
    for chunk in (512, 7):
        other, other_results = run(chunk)
        np.testing.assert_array_equal(other, whole)
        assert other_results == results
    assert len(results["windows"]) == 5


def test_every_zero_scores_nothing_and_bad_settings_are_refused():
    protocol = Prequential(every=0)
    plan = protocol.plan(np.arange(10), np.arange(10), np.arange(10))
    assert plan.size == 0 and protocol.results()["all"]["hr"] is None
    with pytest.raises(ValueError, match="every must be >= 0"):
        Prequential(every=-1)


def test_id_counts_count_each_ids_events_before_it_up_to_the_cap():
    counts = IdCounts(cap=5, buckets=8)  # grows many times
    seen = collections.Counter()
    rng = np.random.default_rng(1)
    for _ in range(100):
        ids = rng.integers(-(2**40), 2**40, 50) // 2**30  # collisions of the hash too
        got = counts.count_and_add(ids).tolist()
        expected = []
        for key in ids.tolist():
            expected.append(min(seen[key], 5))
            seen[key] += 1
        assert got == expected
    assert counts.size == len(seen)


def test_past_its_bounds_the_protocol_holds_the_same_memory_and_counts_no_user_short():
    """10^7 distinct users (a stream of weeks) through a protocol bounded at 2^16 users
    exactly, 1,000 items and 16 windows: its memory once full is its memory at the end;
    a user past the table is counted in the sketch, never below its events."""
    protocol = Prequential(
        every=64,
        negatives=9,
        window_events=10_000,
        max_users=1 << 16,
        max_items=1000,
        max_windows=16,
    )
    chunk, sizes = 4096, {}
    window_bytes = 8 * (2 * 11 + 2 * 10 + 2 * 10)  # its rank, AUC and valid tallies
    for start in range(0, 10_000_000, chunk):
        users = np.arange(start, start + chunk)
        plan = protocol.plan(users, users % 5000, users)
        protocol.record(plan, np.zeros((plan.size, 10)))
        if start + chunk in (1_003_520, 9_998_336):
            windows = len(protocol.results()["windows"])
            sizes[start + chunk] = protocol.nbytes - windows * window_bytes
    assert sizes[1_003_520] == sizes[9_998_336]  # the tables, once full
    results = protocol.results()
    assert len(results["windows"]) <= 16 and results["events"] == 10_002_432
    assert results["cohort_error"] < 1e-3
    # Every user came once: cold, unless the sketch's counters (shared) say otherwise.
    assert results["cold"]["scored"] >= (1 - 1e-3) * results["all"]["scored"]
    assert protocol._seen_items.shape == (1000,)


def test_id_counts_past_max_ids_count_in_a_sketch_that_never_undercounts():
    counts = IdCounts(cap=5, buckets=8, max_ids=20, sketch_counters=1 << 16)
    seen = collections.Counter()
    rng = np.random.default_rng(2)
    for _ in range(50):
        ids = rng.integers(0, 300, 40)
        got = counts.count_and_add(ids).tolist()
        expected = []
        for key in ids.tolist():
            expected.append(min(seen[key], 5))
            seen[key] += 1
        held = [i for i, key in enumerate(ids.tolist()) if counts._find(np.array([key]))[0] >= 0]
        assert all(got[i] == expected[i] for i in held)  # exact where held
        assert all(g >= e for g, e in zip(got, expected, strict=True))  # never fewer
        # 300 ids in 65,536 counters: the sketch has no collision here, so exact too.
        assert got == expected
    assert counts.size == 20


def test_coarser_windows_are_those_of_the_doubled_size_from_the_start():
    rng = np.random.default_rng(3)
    users, items = rng.integers(0, 100, 20_000), rng.integers(0, 50, 20_000)

    def windows(window_events: int, max_windows: int) -> list[dict]:
        protocol = Prequential(
            every=2, negatives=5, window_events=window_events, max_windows=max_windows
        )
        for start in range(0, 20_000, 777):
            part = slice(start, start + 777)
            plan = protocol.plan(users[part], items[part], np.arange(20_000)[part])
            protocol.record(plan, np.cos(plan.candidates * 0.3 + plan.users[:, None]))
        return protocol.results()["windows"]

    # 20 windows of 1,000 doubled twice, to 5 of 4,000.
    assert windows(1000, max_windows=8) == windows(4000, max_windows=8)
    assert len(windows(1000, max_windows=8)) == 5
