"""The names of a step directory's entries in both layouts (no I/O: everything may import
these)."""

from __future__ import annotations

import enum

MAXTEXT_ITEM = "items"  # MaxText's one item: params, opt_state, step, nnx_aux
TUNIX_PARAMS_ITEM = "model_params"  # Tunix's weights and RNG state, mixed
TUNIX_OPT_ITEM = "optimizer_state"  # Tunix's optimizer, in NNX form
ROLES = ("actor", "critic")  # RL keeps each role's steps under <root>/<role>/<n>


class Dest(enum.Enum):
    """Where a source leaf ends up: a section of MaxText's item, or dropped."""

    PARAMS = "params"
    NNX_AUX = "nnx_aux"
    OPT_STATE = "opt_state"
    STEP = "step"
    DROPPED = "dropped"
