"""The stages of an online training step, as name scopes of its graph ops: a profile
(TensorFlow's, `--profile_steps`; `scripts/profile_online_step.py` sums one by stage)
then shows where a step's time goes. A stage's ops inside another's belong to the
inner one (eviction runs inside admission), except in the prequential scoring, a graph
call of its own before the sink trains, whose ops are all its own."""

from __future__ import annotations

import re

ID_LOOKUP = "id_lookup"  # ids to rows, refreshing the rows' priorities, index upkeep
ADMISSION = "admission"  # sightings counted, rows given to new ids
EVICTION = "eviction"  # the candidate pool: victims chosen, expired rows taken
ROW_GATHER = "row_gather"  # the step's rows read from the tables (and their gradients)
ROW_UPDATE = "row_update"  # lazy Adam (or SGD) on the rows the step read
PREQUENTIAL = "prequential_scoring"  # test-then-train: scored before training

STAGES = (ID_LOOKUP, ADMISSION, EVICTION, ROW_GATHER, ROW_UPDATE, PREQUENTIAL)
DENSE = "dense network, loss and its optimiser"


# A scope opened again in one graph is numbered: ``row_update_1``.
_SCOPE = re.compile(rf"({'|'.join(STAGES)})(?:_\d+)?")


def of_op(name: str) -> str:
    """The stage of the op named `name` (its innermost stage scope), else `DENSE`."""
    stages = [scope.group(1) for scope in map(_SCOPE.fullmatch, name.split("/")) if scope]
    if PREQUENTIAL in stages:
        return PREQUENTIAL
    return stages[-1] if stages else DENSE
