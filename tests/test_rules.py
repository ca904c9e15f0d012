"""Each tree rule on its own, over real nested trees (dicts, lists, tuples)."""

from __future__ import annotations

import numpy as np

from orbax_maxtext_layout.base.treepaths import flatten, unflatten
from orbax_maxtext_layout.model import rules as R


def _run(rule, tree):
    flat = flatten(tree)
    kept, dropped = R.apply(rule, {p: p for p in flat})
    return unflatten({new: flat[src] for new, src in kept.items()}), dropped


def test_unwrap_value_at_any_depth_inside_lists_and_tuples():
    x, y, z = np.ones(2), np.zeros(3), np.arange(4)
    tree = {
        "a": [{"value": x}, ({"value": y},)],
        "attn": {"query": {"kernel": {"value": z}}, "value": {"kernel": {"value": x}}},
    }
    got, dropped = _run(R.unwrap_value, tree)
    assert not dropped
    assert got["a"][0] is x and got["a"][1][0] is y
    # The attention 'value' projection is a module, not a Variable wrapper: kept.
    assert got["attn"]["value"]["kernel"] is x and got["attn"]["query"]["kernel"] is z


def test_unwrapped_positions_are_the_keys_unwrap_value_keeps():
    """`scan` renames keys of the original (wrapped) path at these positions: they are
    exactly the keys `unwrap_value` keeps, by the same sole-child rule."""
    x = np.ones(2)
    tree = {
        "base": {"layers_0": {"scale": {"value": x}}},
        "attn": {"query": {"kernel": {"value": x}}, "value": {"kernel": {"value": x}}},
        "only": {"value": {"value": x}},
    }
    paths = list(flatten(tree))
    positions = R.unwrapped_positions(paths)
    renamed = R.unwrap_value(paths)
    assert all(tuple(p[i] for i in positions[p]) == renamed[p] for p in paths)
    assert positions[("attn", "value", "kernel", "value")] == (0, 1, 2)
    assert positions[("base", "layers_0", "scale", "value")] == (0, 1, 2)
    assert positions[("only", "value", "value")] == (0,)  # a Variable wrapping a Variable


def test_chain_to_list_leaves_gaps_and_never_enters_moments():
    c = np.int32(1)
    tree = {"1": {"0": {"count": c, "mu": {"layers": {"0": c, "1": c}}}, "2": {"count": c}}}
    got, _ = _run(R.chain_to_list, tree)
    assert got[0] is None and isinstance(got[1], list) and got[1][1] is None
    assert set(got[1][0]["mu"]["layers"]) == {"0", "1"}  # an nnx.List of layers stays a dict


def test_peel_inject_and_multisteps_report_each_shell_field():
    c = np.int32(1)
    inner = {"1": {"0": {"count": c}}}
    inject = {"count": c, "hyperparams": {"learning_rate": c}, "inner_state": inner}
    ms = {"mini_step": c, "gradient_step": c, "inner_opt_state": inject, "acc_grads": {"w": c}}
    got, dropped = _run(R.peel_multisteps, ms)
    assert got == inject
    assert set(dropped) == {("mini_step",), ("gradient_step",), ("acc_grads", "w")}
    got, dropped = _run(R.peel_inject, got)
    assert got == inner
    assert all("inject_hyperparams shell" in r for r in dropped.values())


def test_a_lone_count_is_not_an_inject_shell():
    tree = {"count": np.int32(1), "mu": {"w": np.ones(1)}}
    got, dropped = _run(R.peel_inject, tree)
    assert got == tree and not dropped


def test_adapter_and_moment_wrapping():
    w = np.ones(1)
    got, _ = _run(R.drop_adapter_in_moments, {"0": {"mu": {"base": {"w": w}}, "count": w}})
    assert got == {"0": {"mu": {"w": w}, "count": w}}
    got, _ = _run(R.wrap_moments, got)
    assert got == {"0": {"mu": {"params": {"w": w}}, "count": w}}
    got, _ = _run(R.drop_adapter, {"base": {"w": w}})
    assert got == {"w": w}


def test_select_chain_member_drops_the_others_with_a_reason():
    c = np.int32(1)
    got, dropped = _run(R.select_chain_member(1), {"0": {"count": c}, "1": {"0": {"count": c}}})
    assert got == {"0": {"count": c}}
    assert dropped == {("0", "count"): "chain member 0 is not in the target optimizer"}
