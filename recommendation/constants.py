"""Constants shared by the NCF stages: defaults, column names and cache keys.

These are defaults, not switches: every value a test or a user may want to change is
also a flag or a function argument, so nothing here ever needs to be monkey-patched.
The names and defaults of the producer/trainer file protocol are in `run_folder`.
"""

# Users with fewer ratings than this are dropped (the NCF and MLPerf protocol).
MIN_NUM_RATINGS = 20

# Negatives per evaluation user under the MLPerf protocol; the NCF paper used 99.
NUM_EVAL_NEGATIVES = 999

# A preprocessing cache older than this is rebuilt, even if nothing else changed.
CACHE_INVALIDATION_SEC = 3600 * 24

# Bump when the layout or the contents of the preprocessing cache change; old caches are
# rebuilt. 2: repeated (user, item) pairs keep only their latest occurrence.
CACHE_FORMAT_VERSION = 2

# Column names of the in-memory raw ratings table.
USER_COLUMN = "user_id"
ITEM_COLUMN = "item_id"
TIMESTAMP_COLUMN = "timestamp"

# Dense indexes fit in int32 for every MovieLens release (ml-32m: 200,948 users,
# 87,585 items); the reference's uint16 items broke on ids above 65,535.
INDEX_DTYPE = "int32"
RAW_ID_DTYPE = "int64"

DEFAULT_DATA_DIR = "/tmp/movielens-data/"
DEFAULT_MODEL_DIR = "/tmp/ncf/"
MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/"

# Feature keys of training and evaluation batches (the reference's names).
VALID_POINT_MASK = "valid_point_mask"
DUPLICATE_MASK = "duplicate_mask"
LABELS = "labels"

# The benchmark name in MLPerf compliance logs.
MLPERF_BENCHMARK = "ncf"
