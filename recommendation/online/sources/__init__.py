"""Where events come from (Python iterables, tailed event files, Redis Streams, Kafka
topics) and how they become batches: parsing, dead letters, the Redis and Kafka
connections (credentials' shared rules) and their group claims, the stream of batches.

Each source hands out (user, item, timestamp) events in chunks (`EventChunk`) and says
where it stands after each chunk (`position`, JSON-able). The trainer stores the
position of the last trained chunk in its checkpoint, gives it back with `restore`
after a restart, and calls `commit` with it once that checkpoint is durable. What
that buys:

- `IterableSource`: a re-iterable collection resumes after the events trained.
- `DirectorySource`: append-only ``*.jsonl`` / ``*.csv`` files in a folder, read in
  name order and tailed as they grow; the byte offsets are the position, so a restart
  resumes exactly after the last checkpointed event. The position also recognises each
  file (its size, a checksum of the bytes before its offset, its inode): a file
  rewritten meanwhile (rotated by copy and truncate, replaced, shortened) is read again
  from its start instead of being skipped to an offset that no longer means anything,
  and a file rotated by rename is read to its end under its new name first.
- `RedisSource` (in `redis_source`): a Redis stream read through a consumer group
  (``XREADGROUP``). Entries are acknowledged (``XACK``) only by `commit`, so whatever
  was delivered but not in a durable checkpoint stays pending and is delivered again
  after a crash: at least once, nothing lost. Pending entries at or before the
  checkpointed id (trained and checkpointed, but not yet acknowledged when the
  trainer died) are acknowledged without training them twice; the entries after the
  restored position that the group delivered since (pending, or acknowledged to a
  newer checkpoint that could not be restored) are read again before new ones.
  Connection failures are retried with back-off. Entries trimmed from the stream
  (``MAXLEN``, ``XTRIM``) before the trainer read them are counted
  (`RedisSource.lost_events`, exactly where the server keeps stream counters: Redis
  >= 7) and reported in a warning.
- `KafkaSource` (in `kafka_source`): every partition of a Kafka topic assigned to the
  trainer with the offset to read next (no group rebalancing; partitions added while
  it runs are found from the topic's metadata). The position holds one next offset per
  partition and the topic's id, so a restore reads exactly what the checkpoint does
  not hold. `commit` commits the checkpoint's offsets as the consumer group's, for lag
  tools only: the checkpoint is the truth. Events deleted by retention before the
  trainer read them are counted exactly in `lost_events`; a topic deleted and created
  again is said, read from its start, and its lost events uncounted
  (`lost_events_exact`). librdkafka reconnects on its own, each outage said once. The
  group is claimed in a claims topic (`kafka_claim`), as a Redis group is in a key
  (`group_claim`).

Every event goes through one conversion, `parse_event` (in `event_parsing`): user and
item ids must be integers in [0, 2**63 - 1] (`MAX_ID`; negative int64 values are
refused because the hash tables reserve two of them), timestamps any int64. An event
that cannot become a training example (bad JSON, a missing field, a wrong type, NaN,
an id out of range, a huge or undecodable text, a line longer than the read block)
never stops training: it goes to a dead-letter sink (a JSON-lines file,
`DeadLetterFile` in `dead_letters`, a Redis stream, or a Kafka topic) with its reason,
and is acknowledged with the events around it. Dead letters are written once per event
(keyed by the event's source id, so a restart that reads an event again does not
record it twice), and their count is part of the position, so that it is checkpointed
and restored with it: `dead_letters` is the total over restarts (and so is a Redis
source's, or a Kafka source's, `lost_events`).
"""

from recommendation.online.sources.files import FINGERPRINT_BYTES, DirectorySource
from recommendation.online.sources.iterable import IterableSource

__all__ = ["FINGERPRINT_BYTES", "DirectorySource", "IterableSource"]
