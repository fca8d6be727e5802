"""A deterministic online event stream (user, item, timestamp) for sizing hash tables
and choosing their eviction policy: ``python -m recommendation.data.event_stream_data``.

    python -m recommendation.data.event_stream_data --events_dir DIR --num_users 2000000 \\
        --num_items 50000 --num_events 10000000 --seed 0 --files 10

writes ``DIR/events-00000.csv``... (``user,item,timestamp`` with a header, the layout
``ncf-online --events_dir`` reads), file i an earlier slice of the stream than file
i + 1. The stream covers `duration_seconds` from `start_timestamp`:

- Users arrive throughout and stay briefly: user u lives L_u ~ Exp(mean
  `mean_lifetime_seconds`) seconds (whole, at most the stream's length), arrives at a
  second a_u uniform in [start, end - L_u] and acts at seconds uniform in
  [a_u, a_u + L_u]. Their activity n_u is 1 plus a multinomial share of the other
  events with Pareto(`activity_tail`) weights: exact in total, most users act a few
  times, a few act thousands of times. The event rate is flat but for a ramp up
  over the first mean lifetime and down over the last.
- Item popularity is a power law that drifts. An event's popularity rank is drawn
  from the density ~ x ** -`popularity_exponent` on [1, N + 1), floored (so
  P(rank r) ~ r ** -exponent, Zipf). The ranking rotates: at fraction f of the stream
  every item has fallen floor(f * `popularity_drift` * N) ranks, the one falling off
  the bottom re-entering at rank 1, so new hits keep appearing and fading (a hit's
  weight decays like (1 + ranks fallen since it entered) ** -exponent).
- Planted preferences: each event draws `candidates` items that way and keeps one
  with probability ~ exp(<u, v_i>) (sampling-importance resampling), with the low-rank
  factors of `synthetic_data`, so a model can learn more than popularity; repeats of
  a (user, item) pair are allowed, as in real click streams. ``candidates=1`` is
  popularity alone.
- Ids are spread over 1..`max_user_id` and 1..`max_item_id` (not dense), so hash
  tables see realistic keys.

Users are generated in arrival order, a block at a time; an event is final once the
next block's first arrival is later (no later user acts earlier), so events come out
in time order. Memory is about 150 bytes per user (ids, arrivals, activity, factors)
plus the events of the users active at once and twice one output file's text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import tensorflow as tf
from absl import app, flags

from official.utils.misc import atomic
from official.utils.misc.progress import ProgressBar
from recommendation.data import synthetic_data
from recommendation.data.movielens import DataError
from recommendation.data.ratings_readers import RawRatings
from recommendation.data.synthetic_data import SyntheticSpec, SyntheticTruth
from recommendation.online.sources.event_parsing import FIELDS, MAX_ID

_BLOCK_EVENTS = 1 << 17  # events generated per block of users (on average)
FILE_EVENTS = 1_000_000  # events per file when the number of files is not given
MAX_FILES = 100_000  # file names have 5 digits, so that name order is time order


@dataclasses.dataclass(frozen=True)
class EventStreamSpec:
    """Size and shape of an event stream; see the module docstring for the model.

    Attributes:
        num_users: Distinct users; each has at least one event.
        num_items: Items in the popularity ranking.
        num_events: Total events (exact).
        start_timestamp: First second of the stream.
        duration_seconds: Length of the stream.
        mean_lifetime_seconds: Mean time from a user's arrival to their last event.
        activity_tail: Pareto shape of per-user activity (smaller: heavier tail).
        popularity_exponent: Zipf exponent of item popularity.
        popularity_drift: Fraction of the ranking that passes through rank 1 over the
            stream (0: no drift).
        candidates: Popularity draws per event that the planted preferences choose
            among (1: no preferences).
        latent_dim: Rank of the planted preferences.
        preference_strength: Standard deviation of the planted affinities <u, v>.
        taste_clusters: Users share one of this many tastes, each with a personal
            share `taste_spread` of its variance (0: every user a taste of their own).
        taste_spread: The personal share of a clustered user's taste variance.
        max_user_id: User ids are drawn from 1..max_user_id.
        max_item_id: Item ids are drawn from 1..max_item_id.
    """

    num_users: int = 2_000_000
    num_items: int = 50_000
    num_events: int = 10_000_000
    start_timestamp: int = 1_700_000_000
    duration_seconds: int = 30 * 86_400
    mean_lifetime_seconds: float = 86_400.0
    activity_tail: float = 2.0
    popularity_exponent: float = 1.0
    popularity_drift: float = 0.02
    candidates: int = 8
    latent_dim: int = 8
    preference_strength: float = 3.0
    taste_clusters: int = 0
    taste_spread: float = 0.2
    max_user_id: int = 10**12
    max_item_id: int = 10**9

    def validate(self) -> None:
        """Raises `DataError` saying which size cannot describe a stream."""
        for name in ("num_users", "num_items", "num_events", "duration_seconds"):
            if getattr(self, name) <= 0:
                raise DataError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("candidates", "latent_dim"):
            if getattr(self, name) < 1:
                raise DataError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("mean_lifetime_seconds", "popularity_exponent"):
            if not 0 < getattr(self, name) < float("inf"):  # NaN too
                raise DataError(f"{name} must be finite and positive, got {getattr(self, name)}")
        if not 0.1 <= self.activity_tail < float("inf"):  # below, Pareto weights overflow
            raise DataError(f"activity_tail must be at least 0.1, got {self.activity_tail}")
        if self.taste_clusters < 0:
            raise DataError(f"taste_clusters must be >= 0, got {self.taste_clusters}")
        if not 0 <= self.taste_spread <= 1:
            raise DataError(f"taste_spread must be in [0, 1], got {self.taste_spread}")
        for name in ("popularity_drift", "preference_strength"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise DataError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.num_events < self.num_users:
            raise DataError(
                f"num_events ({self.num_events:,}) must be at least num_users "
                f"({self.num_users:,}): every user arrives with at least one event"
            )
        for ids, count in (("max_user_id", "num_users"), ("max_item_id", "num_items")):
            if not getattr(self, count) <= getattr(self, ids) <= MAX_ID:
                raise DataError(
                    f"{ids} must be in [{count} = {getattr(self, count):,}, {MAX_ID}], "
                    f"got {getattr(self, ids):,}"
                )
        if not 0 <= self.start_timestamp <= MAX_ID - self.duration_seconds:
            raise DataError(f"start_timestamp {self.start_timestamp} puts the stream past int64")


@dataclasses.dataclass(frozen=True)
class EventStreamModel:
    """The users and items behind a stream, user rows in arrival order.

    Attributes:
        user_ids: `(num_users,)` raw id of each user row.
        arrivals: `(num_users,)` nondecreasing arrival second of each user row.
        lifetimes: `(num_users,)` seconds from arrival to the last possible event.
        activity: `(num_users,)` events of each user row (summing to num_events).
        rank_items: `(num_items,)` item rows by popularity at the start, most popular first.
        planted: Item ids and the planted factors (user rows as above).
    """

    user_ids: np.ndarray
    arrivals: np.ndarray
    lifetimes: np.ndarray
    activity: np.ndarray
    rank_items: np.ndarray
    planted: SyntheticTruth


def _generators(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent generators for the model and for the events (same seed, same both)."""
    if seed < 0:
        raise DataError(f"seed must not be negative, got {seed}")
    model_seed, events_seed = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(model_seed), np.random.default_rng(events_seed)


def plant(spec: EventStreamSpec, seed: int) -> EventStreamModel:
    """The users and items of `spec` and `seed` (what `iter_events` draws from)."""
    spec.validate()
    rng = _generators(seed)[0]
    planted = synthetic_data._plant_model(
        SyntheticSpec(
            num_users=spec.num_users,
            num_items=spec.num_items,
            num_ratings=spec.num_events,
            latent_dim=spec.latent_dim,
            preference_strength=spec.preference_strength,
            popularity_exponent=spec.popularity_exponent,
            max_item_id=spec.max_item_id,
        ),
        rng,
    )
    if spec.taste_clusters:
        planted = _clustered(spec, planted, rng)
    user_ids = rng.choice(spec.max_user_id, spec.num_users, replace=False) + 1
    lifetimes = np.minimum(
        np.floor(rng.exponential(spec.mean_lifetime_seconds, spec.num_users)),
        spec.duration_seconds - 1,
    ).astype(np.int64)
    arrivals = spec.start_timestamp + rng.integers(0, spec.duration_seconds - lifetimes)
    weights = rng.pareto(spec.activity_tail, spec.num_users)
    extra = spec.num_events - spec.num_users
    activity = 1 + rng.multinomial(extra, weights / weights.sum())
    order = np.argsort(arrivals, kind="stable")
    return EventStreamModel(
        user_ids=user_ids[order].astype(np.int64),
        arrivals=arrivals[order],
        lifetimes=lifetimes[order],
        activity=activity[order].astype(np.int64),
        # The planted log weights are -exponent * log(rank): their order is the ranking.
        rank_items=np.argsort(-planted.item_log_weight, kind="stable"),
        planted=dataclasses.replace(planted, user_factors=planted.user_factors[order]),
    )


def _clustered(
    spec: EventStreamSpec, planted: SyntheticTruth, rng: np.random.Generator
) -> SyntheticTruth:
    """`planted` with each user's taste one of `taste_clusters` shared ones plus its
    own (a `taste_spread` share of the variance), the affinities' spread unchanged:
    a user's first events tell their cluster, so their history predicts the rest."""
    scale = np.sqrt(spec.preference_strength / np.sqrt(spec.latent_dim))
    centres = rng.standard_normal((spec.taste_clusters, spec.latent_dim)) * scale
    members = rng.integers(0, spec.taste_clusters, spec.num_users)
    shared = np.sqrt(1.0 - spec.taste_spread) * centres[members]
    own = np.sqrt(spec.taste_spread) * planted.user_factors
    return dataclasses.replace(planted, user_factors=(shared + own).astype(np.float32))


def iter_events(
    spec: EventStreamSpec, seed: int, model: EventStreamModel | None = None
) -> Iterator[RawRatings]:
    """Yields the stream of `spec` and `seed` in time order, a block at a time.

    Events of the same second keep the order they were drawn in (by user arrival),
    so the same inputs give the same sequence.
    """
    model = plant(spec, seed) if model is None else model
    rng = _generators(seed)[1]
    block_users = max(1, _BLOCK_EVENTS * spec.num_users // spec.num_events)
    pending_users = np.empty(0, np.int64)  # drawn events later than the next arrival
    pending_items = np.empty(0, np.int64)
    pending_times = np.empty(0, np.int64)
    for start in range(0, spec.num_users, block_users):
        stop = min(start + block_users, spec.num_users)
        users = np.repeat(np.arange(start, stop), model.activity[start:stop])
        times = model.arrivals[users] + rng.integers(0, model.lifetimes[users] + 1)
        items = _draw_items(spec, model, users, times, rng)
        times = np.concatenate([pending_times, times])
        order = np.argsort(times, kind="stable")  # a sorted run and a new block: a merge
        times = times[order]
        users = np.concatenate([pending_users, users])[order]
        items = np.concatenate([pending_items, items])[order]
        final = (
            np.searchsorted(times, model.arrivals[stop]) if stop < spec.num_users else len(times)
        )
        pending_users, pending_items, pending_times = users[final:], items[final:], times[final:]
        yield RawRatings(
            users=model.user_ids[users[:final]],
            items=model.planted.item_ids[items[:final]],
            timestamps=times[:final],
        )


def _draw_items(
    spec: EventStreamSpec,
    model: EventStreamModel,
    users: np.ndarray,
    times: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """Item rows of events by `users` at `times`: drifting Zipf draws, then preferences."""
    num_items, exponent = spec.num_items, spec.popularity_exponent
    uniform = rng.random((len(users), spec.candidates))
    log_end = np.log(num_items + 1.0)
    if exponent == 1.0:  # inverse of the power-law CDF on [1, num_items + 1)
        ranks = np.exp(uniform * log_end)
    else:  # (1 + u * ((n + 1) ** (1 - a) - 1)) ** (1 / (1 - a)), stable near a = 1
        span = np.expm1((1.0 - exponent) * log_end)
        ranks = np.exp(np.log1p(uniform * span) / (1.0 - exponent))
    ranks = np.minimum(ranks.astype(np.int64), num_items) - 1  # 0 = most popular
    fraction = (times - spec.start_timestamp) / spec.duration_seconds
    fallen = np.floor(fraction * (spec.popularity_drift * num_items)).astype(np.int64)
    candidates = model.rank_items[(ranks - fallen[:, None]) % num_items]
    if spec.candidates == 1:
        return candidates[:, 0]
    affinity = np.einsum(
        "nd,ncd->nc", model.planted.user_factors[users], model.planted.item_factors[candidates]
    )
    # Exponential race: the smallest E_i / exp(affinity_i) wins with p ~ exp(affinity_i);
    # compared as logs, which do not overflow.
    with np.errstate(divide="ignore"):  # a draw of 0 (float32) wins outright: log -inf
        keys = np.log(rng.standard_exponential(affinity.shape, dtype=np.float32)) - affinity
    return np.take_along_axis(candidates, np.argmin(keys, axis=1)[:, None], axis=1)[:, 0]


def generate(spec: EventStreamSpec, seed: int) -> RawRatings:
    """The whole stream of `spec` and `seed` in memory (for small streams and tests)."""
    blocks = list(iter_events(spec, seed))
    return RawRatings(
        users=np.concatenate([block.users for block in blocks]),
        items=np.concatenate([block.items for block in blocks]),
        timestamps=np.concatenate([block.timestamps for block in blocks]),
    )


def file_name(index: int) -> str:
    """Name of the `index`-th event file (name order is time order)."""
    return f"events-{index:05d}.csv"


def write_event_files(
    spec: EventStreamSpec,
    seed: int,
    directory: str,
    num_files: int | None = None,
    show_progress: bool = False,
    model: EventStreamModel | None = None,
    on_block: Callable[[RawRatings], None] | None = None,
) -> list[str]:
    """Writes the stream as `num_files` CSV files (default: one per `FILE_EVENTS`
    events) of nearly equal size, each atomically and in time order, so a trainer
    tailing `directory` can start on the first files while later ones are made;
    `on_block` sees each block of the stream as it is written (`model`: the
    stream's, when the caller has planted it).

    Raises:
        DataError: Bad sizes, a folder that cannot be written or already holds event
            files (a trainer would read them with these).
    """
    spec.validate()
    if num_files is None:
        num_files = -(-spec.num_events // FILE_EVENTS)
    if not 1 <= num_files <= min(spec.num_events, MAX_FILES):
        raise DataError(
            f"files must be in [1, {min(spec.num_events, MAX_FILES):,}] (at most one per event "
            f"and {MAX_FILES:,}), got {num_files}"
        )
    _prepare_folder(directory)
    bounds = [index * spec.num_events // num_files for index in range(num_files + 1)]
    paths: list[str] = []
    parts: list[bytes] = []  # CSV text of the file being filled
    written = 0
    progress = (
        ProgressBar(spec.num_events, "generating events", " events") if show_progress else None
    )
    for block in iter_events(spec, seed, model):
        if on_block:
            on_block(block)
        offset = 0
        while offset < len(block):
            take = min(len(block) - offset, bounds[len(paths) + 1] - written)
            parts.append(_csv_bytes(block, offset, offset + take, header=not parts))
            offset += take
            written += take
            if written == bounds[len(paths) + 1]:
                paths.append(os.path.join(directory, file_name(len(paths))))
                _write(paths[-1], b"".join(parts))
                parts = []
        if progress:
            progress.update(len(block))
    if progress:
        progress.close()
    return paths


def _prepare_folder(directory: str) -> None:
    try:
        tf.io.gfile.makedirs(directory)
        present = sorted(
            name for name in tf.io.gfile.listdir(directory) if name.endswith((".csv", ".jsonl"))
        )
    except (tf.errors.OpError, OSError) as error:
        raise DataError(f"cannot write to {directory}: {_reason(error)}") from None
    if present:
        raise DataError(
            f"{directory} already holds {len(present)} event file(s) ({present[0]}, ...), "
            f"which a trainer would read with the new ones: choose an empty folder"
        )


def _write(path: str, data: bytes) -> None:
    try:
        atomic.write_file(path, data)
    except (tf.errors.OpError, OSError) as error:
        raise DataError(f"cannot write {path}: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    return error.message if isinstance(error, tf.errors.OpError) else str(error)


def _csv_bytes(events: RawRatings, start: int, stop: int, header: bool) -> bytes:
    table = pa.table(
        dict(
            zip(
                FIELDS,
                (events.users[start:stop], events.items[start:stop], events.timestamps[start:stop]),
                strict=True,
            )
        )
    )
    text = pa.BufferOutputStream()
    options = pa_csv.WriteOptions(
        include_header=header, quoting_style="none", quoting_header="none"
    )
    pa_csv.write_csv(table, text, options)
    return text.getvalue().to_pybytes()


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (defined on demand, so importing this module defines none)."""
    defaults = EventStreamSpec()
    flags.DEFINE_string("events_dir", None, "Folder to write events-NNNNN.csv into.")
    flags.DEFINE_integer("num_users", defaults.num_users, "Distinct users.")
    flags.DEFINE_integer("num_items", defaults.num_items, "Items.")
    flags.DEFINE_integer("num_events", defaults.num_events, "Events (exact).")
    flags.DEFINE_integer(
        "candidates",
        defaults.candidates,
        "Popularity draws each event chooses among by the user's taste (1: popularity alone).",
    )
    flags.DEFINE_float(
        "preference_strength",
        defaults.preference_strength,
        "Standard deviation of the planted user-item affinities (0: no taste).",
    )
    flags.DEFINE_integer(
        "taste_clusters",
        defaults.taste_clusters,
        "Users share one of this many tastes, with a personal part (0: each their own).",
    )
    flags.DEFINE_integer("seed", 0, "Random seed; the same seed writes the same files.")
    flags.DEFINE_integer(
        "files", None, f"Files to split the stream into (default: one per {FILE_EVENTS:,} events)."
    )
    flags.mark_flag_as_required("events_dir")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    spec = EventStreamSpec(
        num_users=FLAGS.num_users,
        num_items=FLAGS.num_items,
        num_events=FLAGS.num_events,
        candidates=FLAGS.candidates,
        preference_strength=FLAGS.preference_strength,
        taste_clusters=FLAGS.taste_clusters,
    )
    # Imported here: the references read this module's model.
    from recommendation.data import stream_references

    start = time.monotonic()
    try:
        spec.validate()
        model = plant(spec, FLAGS.seed)
        references = stream_references.StreamReferences(spec, model)
        paths = write_event_files(
            spec, FLAGS.seed, FLAGS.events_dir, FLAGS.files, True, model, references.add
        )
        scores = references.results()
        reference_path = os.path.join(FLAGS.events_dir, stream_references.FILE_NAME)
        record = {"seed": FLAGS.seed, "spec": dataclasses.asdict(spec), **scores}
        _write(reference_path, (json.dumps(record, indent=1) + "\n").encode())
    except DataError as error:
        sys.exit(f"error: {error}")
    print(
        f"wrote {spec.num_events:,} events of {spec.num_users:,} users on "
        f"{spec.num_items:,} items to {len(paths)} file(s) in {FLAGS.events_dir} "
        f"in {time.monotonic() - start:.1f} s"
    )
    for name, result in scores.items():
        print(
            f"{name} reference: prequential HR@10 {result['all']['hr']:.4f} "
            f"(cold {result['cold']['hr']:.4f}, warm {result['warm']['hr']:.4f}; "
            f"{result['all']['scored']:,} scored)"
        )
    print(f"reference scores: {reference_path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
