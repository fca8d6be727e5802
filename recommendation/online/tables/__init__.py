"""The hash embeddings and what serves them: the id index, admission, eviction, the
rows' training, their shards on a cluster and the changes a delta checkpoint holds."""
