"""Tree paths: `flatten` gives normal keys, the one normalisation every module relies on."""

from __future__ import annotations

from collections import namedtuple

import jax
import numpy as np
from flax import nnx

from orbax_maxtext_layout.base.treepaths import flatten, norm_key

State = namedtuple("State", ["count", "mu"])


def test_flatten_keys_are_normal_and_match_jax_key_paths():
    """Mapping keys (int ones too) come out as str, positions as int, so a path from
    `flatten` equals the `norm_key` form of the same leaf's jax key path: restores look
    leaves up across the two without normalising again."""
    x = np.ones(2)
    tree = {
        "opt_state": [None, (State(count=x, mu={"params": {"w": x}}),)],
        "chain": {0: {"count": x}, 2: {"count": x}},
        "state": nnx.State({"layers": {"0": {"kernel": x}}}),
    }
    flat = flatten(tree)
    assert all(type(k) in (str, int) and norm_key(k) == k for p in flat for k in p)
    assert ("opt_state", 1, 0, "mu", "params", "w") in flat
    assert ("chain", "2", "count") in flat and ("state", "layers", "0", "kernel") in flat
    jax_paths = {
        tuple(norm_key(k) for k in kp) for kp, _ in jax.tree_util.tree_leaves_with_path(tree)
    }
    assert jax_paths == set(flat)


def test_the_old_module_name_still_imports_the_same_functions():
    from orbax_maxtext_layout import paths
    from orbax_maxtext_layout.base import treepaths

    assert paths.flatten is treepaths.flatten and paths.unflatten is treepaths.unflatten
    assert set(paths.__all__) == {n for n in dir(treepaths) if not n.startswith("_")} - {
        "Any",
        "Callable",
        "Iterable",
        "Mapping",
        "annotations",
    }
