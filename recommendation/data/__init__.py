"""Raw data to index arrays: the dataset registry and its files, readers of ratings
files, preprocessing (dedup, filtering, indexing, the holdout, the cache), and the
synthetic generators (offline ratings, online event streams)."""
