"""Training from unbounded event streams: `RecModel` (MindSpore Rec's API) and what it is
built from: events parsed once (`event_parsing`, `dead_letters`) from a source
(`sources`, `redis_source`), batched into steps (`event_stream`, `stream_batches`);
hash embeddings whose cost follows the ids they hold (`hash_embedding`, `id_index`,
`admission`, `eviction`, `table_changes`); online NeuMF (`online_ncf`); callbacks,
incremental checkpoints and versioned exports."""
