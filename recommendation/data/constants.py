"""Constants shared by the NCF stages: protocol defaults, default places, the cache
format version, id dtypes, feature keys and the MLPerf benchmark name.

The defaults are only defaults: each is the default of a config field (set by a flag or
an argument), so nothing here needs to be monkey-patched. The producer/trainer file
protocol (run-folder layout, file names) is `run_folder`'s; NCF's MLPerf v0.5 tag set
is `mlperf_tags`.
"""

# Users with fewer ratings than this are dropped (the NCF and MLPerf protocol).
MIN_NUM_RATINGS = 20

# What each train/eval cycle evaluates on (--eval_split). "test": every user's last
# interaction, the MLPerf and NCF protocol. "validation": the second-to-last (the paper
# split: the latest training line) is held out too; cycles evaluate on it, and the test
# holdout is evaluated once, on the epoch validation selects.
TEST_SPLIT = "test"
VALIDATION_SPLIT = "validation"
EVAL_SPLITS = (TEST_SPLIT, VALIDATION_SPLIT)

# How an evaluation ranks each held-out item (--eval_ranking): against its sampled
# negatives (the MLPerf and NCF protocol), against every item the user has not
# interacted with (the full catalogue), or both.
SAMPLED_RANKING = "sampled"
FULL_RANKING = "full"
BOTH_RANKINGS = "both"
EVAL_RANKINGS = (SAMPLED_RANKING, FULL_RANKING, BOTH_RANKINGS)

# Negatives per evaluation user under the MLPerf protocol; the NCF paper used 99 (its
# split's fixed test negatives, and the ones its validation samples).
NUM_EVAL_NEGATIVES = 999
NCF_EVAL_NEGATIVES = 99

# A preprocessing cache older than this is rebuilt, even if nothing else changed.
CACHE_INVALIDATION_SEC = 3600 * 24

# Bump when the layout or the contents of the preprocessing cache change; old caches are
# rebuilt. 2: repeated (user, item) pairs keep only their latest occurrence.
CACHE_FORMAT_VERSION = 2

# Feature keys of the user and item ids (model inputs, the export's argument names).
USER_COLUMN = "user_id"
ITEM_COLUMN = "item_id"
# Event times (int64 seconds) of online training batches.
TIME_COLUMN = "timestamp"

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
