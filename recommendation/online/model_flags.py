"""ncf-online's flags for its model (`online_ncf.OnlineParams`): the hash tables, who
gets a row and who loses one, and how the rows train."""

from __future__ import annotations

from official.utils.flags.core import POSITIVE, POSITIVE_OR_UNSET, Check, FlagSpec
from recommendation.online.tables import eviction
from recommendation.online.tables.row_training import ROW_OPTIMIZERS


def _parses_as_policy(value: str | None) -> bool:
    try:
        return value is None or bool(eviction.parse_policy(value))
    except ValueError:
        return False


EVICTION_POLICY = Check(
    _parses_as_policy,
    "--{flag} must be none, lru, lfu, lfu:HALF_LIFE_STEPS, ttl:STEPS or ttl:SECONDSs",
)

MODEL_FLAGS = (
    FlagSpec(
        "user_capacity",
        "Rows of the user hash table.",
        field="model.user_capacity",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "item_capacity",
        "Rows of the item hash table.",
        field="model.item_capacity",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "permit_filter_value",
        "Sightings before an id gets its own row.",
        field="model.permit_filter_value",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "user_evict_policy",
        "What a full user table does: none (refuse new users), lru, lfu[:HALF_LIFE_STEPS], "
        "ttl:STEPS or ttl:SECONDSs (of event time); default lru.",
        field="model.user_eviction",
        checks=(EVICTION_POLICY,),
    ),
    FlagSpec(
        "item_evict_policy",
        "As --user_evict_policy, for the item table.",
        field="model.item_eviction",
        checks=(EVICTION_POLICY,),
    ),
    FlagSpec(
        "evict_filter_value",
        "Free rows unseen for this many steps (both tables' policy ttl:N).",
        field="model.evict_filter_value",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec(
        "admit_probability",
        "Chance that a sighting of an id without a row (past --permit_filter_value) admits it.",
        field="model.admit_probability",
        checks=(Check(lambda value: 0 < value <= 1, "--{flag} must be in (0, 1]"),),
    ),
    FlagSpec(
        "max_norm",
        "Clip embedding rows to this norm.",
        field="model.max_norm",
        checks=(POSITIVE_OR_UNSET,),
    ),
    FlagSpec(
        "row_optimizer",
        "How the tables' rows train, only the rows each step uses: adam (two moments a "
        "row), adagrad (row-wise: one accumulator a row) or sgd.",
        field="model.row_optimizer",
        choices=ROW_OPTIMIZERS,
    ),
    FlagSpec(
        "row_learning_rate",
        "The rows' learning rate (the dense layers' is --learning_rate).",
        field="model.row_learning_rate",
        checks=(POSITIVE,),
    ),
    FlagSpec(
        "bias_terms",
        "End each row with its id's bias, added to the logit (an item's popularity, at "
        "the rows' rate).",
        field="model.bias_terms",
    ),
)
