"""Scanned layers: axes from the model, unroll/stack/unstack_layer, each failure class fixed.

Oracles: the unscanned and scanned forms of one writers model hold the same weights
layer by layer (RNG count of layer ``i`` is ``i``), and the real fixtures' stacked
arrays sliced on the axis the model gives. Every comparison is bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import writers as W
from conftest import FIXTURES, MAXTEXT_NATIVE, stock_restore
from flax import nnx

from orbax_maxtext_layout import LayoutMismatchError, Target
from orbax_maxtext_layout.base.treepaths import flatten
from orbax_maxtext_layout.model.layer_axes import layer_map, scan_axes
from orbax_maxtext_layout.model.layermap import layer_of
from orbax_maxtext_layout.model.scan_targets import stack_target, unroll_target
from orbax_maxtext_layout.model.scan_trees import stack, unroll, unstack_layer
from orbax_maxtext_layout.orbax_io.spec import LeafSpec, read_specs
from orbax_maxtext_layout.plan.step_plan import make_plan

LAYERS = ("decoder", "layers")


# -- helpers --------------------------------------------------------------------------
def _flat(tree) -> dict:
    return flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw(x) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _assert_same(got, want) -> None:
    """Same paths, bytes, shapes and dtypes (typed keys stay typed)."""
    _same_leaves(_flat(got), _flat(want))


def _same_leaves(got: dict, want: dict) -> None:
    assert sorted(map(str, got)) == sorted(map(str, want))
    for p in want:
        assert str(got[p].dtype) == str(want[p].dtype), p
        assert _raw(got[p]).shape == _raw(want[p]).shape, p
        assert _raw(got[p]).tobytes() == _raw(want[p]).tobytes(), p


def _items(model, optimizer=None) -> dict:
    """MaxText's items tree of a live model (as `writers.write_maxtext_step` saves it)."""
    params, _, aux = nnx.state(model, nnx.Param, (nnx.Intermediate, nnx.Cache), ...)
    items = {"params": {"params": params.to_pure_dict()}, "nnx_aux": {"model": aux.to_pure_dict()}}
    if optimizer is not None:
        opt = nnx.state(optimizer, nnx.optimizer.OptState).to_pure_dict()
        items["opt_state"] = W.opt_state_to_linen(opt["opt_state"])
        items["step"] = opt["step"]
    return items


def _tunix(tree) -> dict:
    """A pure state tree as Tunix stores it: every leaf under a ``value`` level."""
    return jax.tree.map(lambda x: {"value": x}, tree)


def _restore(rel: str) -> dict:
    return stock_restore((FIXTURES / rel).resolve())


def _take(x, axis: int, i: int):
    return x[(slice(None),) * axis + (i,)]


def _mixed_axes(num_layers: int = 3):
    """(unscanned, scanned) with ``wi`` stacked on 2 and ``wo`` on 0 (both carrying
    ``param_scan_axis``), and the norm scale on 1 *without* the metadata."""
    unscanned = W.make_model(scanned=False, num_layers=num_layers)
    scanned = W.stack_model(unscanned, param_scan_axis=1)
    layers = [getattr(W.get_decoder(unscanned), f"layers_{i}") for i in range(num_layers)]
    block = W.get_decoder(scanned).layers
    wi = jnp.stack([la.mlp.wi.kernel.get_value() for la in layers], axis=2)
    wo = jnp.stack([la.mlp.wo.kernel.get_value() for la in layers], axis=0)
    scale = [la.pre_self_attention_layer_norm.scale.get_value() for la in layers]
    block.mlp.wi.kernel = nnx.Param(wi, param_scan_axis=2)
    block.mlp.wo.kernel = nnx.Param(wo, param_scan_axis=0)
    block.pre_self_attention_layer_norm.scale = nnx.Param(jnp.stack(scale, axis=1))
    return unscanned, scanned


def _sds(shape, dtype=np.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


KEY = jax.random.key(0).dtype


# -- scan_axes ------------------------------------------------------------------------
def test_scan_axes_from_nnx_variable_type_and_metadata():
    _, scanned = _mixed_axes()
    target = Target.from_nnx(scanned)
    P, A = ("params", "params", *LAYERS), ("nnx_aux", "model", *LAYERS)
    for default in (1, 0):
        axes = scan_axes(target, param_scan_axis=default)
        assert axes[(*P, "mlp", "wi", "kernel")] == 2  # own metadata wins
        assert axes[(*P, "mlp", "wo", "kernel")] == 0
        assert axes[(*P, "pre_self_attention_layer_norm", "scale")] == default  # no metadata
        assert axes[(*A, "dropout", "rngs", "dropout", "count")] == 0
        assert axes[(*A, "dropout", "rngs", "dropout", "key")] == 0
        assert axes[(*A, "routing_table")] == 0
        assert axes[("params", "params", "token_embedder", "embedding")] is None
        assert axes[("nnx_aux", "model", "decoder", "rngs", "params", "key")] is None


def test_scan_axes_from_maxtext_layout_by_section_and_argument():
    model = W.make_model(scanned=True)
    opt = W.make_optimizer(model, "rl")
    target = Target.from_items(_items(model, opt))
    assert target.param_scan_axes == {}
    for default in (1, 2):
        axes = scan_axes(target, param_scan_axis=default)
        assert axes[("params", "params", *LAYERS, "mlp", "wi", "kernel")] == default
        assert axes[("nnx_aux", "model", *LAYERS, "routing_table")] == 0
        mu = ("opt_state", "inner_state", "1", "0", "mu", *LAYERS, "mlp", "wo", "kernel")
        assert axes[mu] == default  # moments mirror the Params
        assert axes[("opt_state", "inner_state", "1", "0", "count")] is None
        assert axes[("params", "params", "decoder", "decoder_norm", "scale")] is None
    assert set(axes) == {("params", "params", *p) for p in target.params} | {
        ("nnx_aux", "model", *p) for p in target.nnx_aux
    } | {("opt_state", *p) for p in target.opt_state}


# -- the unrolled form is the unscanned model, layer by layer -----------------------
@pytest.mark.parametrize("axis", [0, 1])  # axis 2 (rank >= 2 Params only): mixed test below
def test_unroll_equals_unscanned_model_and_round_trips(axis):
    scanned = W.make_model(scanned=True, param_scan_axis=axis)
    unscanned = W.make_model(scanned=False)
    target = Target.from_nnx(scanned)  # axes from the Params' metadata
    by_path = Target.from_items(_items(scanned))  # axes from the argument
    for t, kw in ((target, {}), (by_path, {"param_scan_axis": axis})):
        flat = unroll(_items(scanned), t, **kw)
        _assert_same(flat, _items(unscanned))
        back, report = stack(flat, t, **kw)
        _assert_same(back, _items(scanned))
        assert not report.fresh
        # and from the unscanned model's own state
        back, report = stack(_items(unscanned), t, **kw)
        _assert_same(back, _items(scanned))
        assert not report.fresh


def test_mixed_param_axes_0_and_2_round_trip():
    unscanned, scanned = _mixed_axes()
    target = Target.from_nnx(scanned)
    _assert_same(unroll(_items(scanned), target), _items(unscanned))
    _assert_same(stack(_items(unscanned), target)[0], _items(scanned))


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_round_trip_with_optimizer_moments_bit_for_bit(kind):
    """stack(unroll(x)) == x for weights, mu/nu and RNG, in MaxText and Tunix layouts."""
    model = W.make_model(scanned=True, adapter=True)
    opt = W.make_optimizer(model, kind)
    W.train_steps(model, opt, 2)
    items = _items(model.base, opt)
    target = Target.from_nnx(model.base, opt_state=items["opt_state"])
    flat = unroll(items, target)
    mu = next(p for p in _flat(items) if "mu" in p and p[-5:] == (*LAYERS, "mlp", "wi", "kernel"))
    j = mu.index("layers")
    for i in range(3):  # moments sliced on the Param's axis
        got = _flat(flat)[(*mu[:j], f"layers_{i}", *mu[j + 1 :])]
        assert _raw(got).tobytes() == _raw(_take(_flat(items)[mu], 1, i)).tobytes()
    back, report = stack(flat, target)
    _assert_same(back, items)
    assert not report.fresh

    # Tunix layout: base/ adapter, value levels, NNX optimizer form.
    params = _tunix(nnx.state(model).to_pure_dict())
    optimizer = _tunix(nnx.state(opt, nnx.optimizer.OptState).to_pure_dict())
    for tree in (params, optimizer):
        flat = unroll(tree, target)
        assert all("layers" not in p for p in _flat(flat))
        _assert_same(stack(flat, target)[0], tree)


# -- each failure class ---------------------------------------------------------------
def test_rng_counts_of_shape_L_slice_on_axis_0():
    """Failure 22: one global axis 1 raises IndexError on an (L,) count."""
    model = W.make_model(scanned=True, num_layers=4)
    items = _items(model)
    count = _flat(items)[("nnx_aux", "model", *LAYERS, "dropout", "rngs", "dropout", "count")]
    with pytest.raises(IndexError):
        _take(count, 1, 0)  # the transfer_state_directly rule
    flat = _flat(unroll(items, Target.from_nnx(model)))
    for i in range(4):
        rng = ("nnx_aux", "model", "decoder", f"layers_{i}", "dropout", "rngs", "dropout")
        assert flat[(*rng, "count")].shape == ()
        assert int(flat[(*rng, "count")]) == i  # layer i has drawn i times


def _gemma_like(num_layers: int, *, stacked_count: bool) -> tuple[Target, dict]:
    """A block holding one Param stacked on 1 and a scan-broadcast scalar RNG stream."""
    L = num_layers
    count_shape = (L,) if stacked_count else ()
    abstract = {
        "params": {"params": {"decoder": {"layers": {"mlp": {"kernel": _sds((2, L, 2))}}}}},
        "nnx_aux": {
            "model": {
                "decoder": {
                    "layers": {
                        "rngs": {
                            "params": {
                                "count": _sds(count_shape, np.uint32),
                                "key": _sds((), KEY),
                            }
                        }
                    }
                }
            }
        },
    }
    kernel = np.arange(4 * L, dtype=np.float32).reshape(2, L, 2)
    tree = {
        "params": {"params": {"decoder": {"layers": {"mlp": {"kernel": kernel}}}}},
        "nnx_aux": {
            "model": {
                "decoder": {
                    "layers": {
                        "rngs": {"params": {"count": np.uint32(7), "key": jax.random.key(3)}}
                    }
                }
            }
        },
    }
    return Target.from_items(abstract), tree


@pytest.mark.parametrize("stacked_count", [False, True])
def test_scalar_in_scanned_block_is_replicated_per_layer(stacked_count):
    """Failure 23: an unstacked scalar came back as a 1-tuple (layer >= 1 failed)."""
    target, tree = _gemma_like(40, stacked_count=stacked_count)
    count = tree["nnx_aux"]["model"]["decoder"]["layers"]["rngs"]["params"]["count"]
    with pytest.raises(IndexError):
        (count,)[33]  # what skipping the scalar in a pure unstack left: a 1-tuple
    flat = _flat(unroll(tree, target))
    for i in (0, 33, 39):
        rng = ("nnx_aux", "model", "decoder", f"layers_{i}", "rngs", "params")
        assert int(flat[(*rng, "count")]) == 7
        assert _raw(flat[(*rng, "key")]).tobytes() == _raw(jax.random.key(3)).tobytes()
        kernel = flat[("params", "params", "decoder", f"layers_{i}", "mlp", "kernel")]
        assert np.array_equal(
            kernel, tree["params"]["params"]["decoder"]["layers"]["mlp"]["kernel"][:, i]
        )
    if not stacked_count:  # the target holds one value: stacking gives it back as is
        _assert_same(stack(unroll(tree, target), target)[0], tree)
        unrolled = unroll(tree, target)
        for i in range(1, 40):  # held by one layer only, it is still carried over
            del unrolled["nnx_aux"]["model"]["decoder"][f"layers_{i}"]
        back, report = stack(unrolled, target)
        _assert_same(back, tree)
        assert not report.fresh


def test_unknown_or_misshaped_block_leaf_is_named():
    target, tree = _gemma_like(5, stacked_count=True)
    layers = tree["nnx_aux"]["model"]["decoder"]["layers"]
    layers["extra"] = {"count": np.uint32(1)}  # not in the target: its axis is unknown
    tree["params"]["params"]["decoder"]["layers"]["mlp"]["kernel"] = np.zeros((2, 4, 2))
    with pytest.raises(LayoutMismatchError) as e:
        unroll(tree, target)
    problems = "\n".join(e.value.problems)
    assert (
        "nnx_aux/model/decoder/layers/extra/count: in a scanned block but not in the target"
        in problems
    )
    assert (
        "params/params/decoder/layers/mlp/kernel: found [2, 4, 2], expected [2, 5, 2]" in problems
    )
    assert "or [2, 2] (one value for every layer)" in problems


def test_raw_L_2_keys_slice_on_axis_0_and_keep_trailing_dim():
    """Failure 24: rank rules slice a raw (L, 2) key on axis 1 (silently, when L == 2)."""
    model = W.make_model(scanned=True, num_layers=2)
    target = Target.from_nnx(model)
    items = _items(model)
    key_path = ("nnx_aux", "model", *LAYERS, "dropout", "rngs", "dropout", "key")
    typed = _flat(items)[key_path]
    raw = np.asarray(jax.random.key_data(typed))  # what restore_type=np.ndarray gives
    assert raw.shape == (2, 2)
    assert not np.array_equal(_take(raw, 1, 0), raw[0])  # the rank rule: right shape, wrong data
    aux = items["nnx_aux"]["model"]["decoder"]["layers"]["dropout"]["rngs"]["dropout"]
    aux["key"] = raw
    flat = _flat(unroll(items, target))
    for i in range(2):
        got = flat[
            ("nnx_aux", "model", "decoder", f"layers_{i}", "dropout", "rngs", "dropout", "key")
        ]
        assert isinstance(got, np.ndarray) and got.dtype == np.uint32 and got.shape == (2,)
        assert np.array_equal(got, np.asarray(jax.random.key_data(typed[i])))
    back = _flat(stack(unroll(items, target), target)[0])
    assert np.array_equal(back[key_path], raw)


def test_rank_2_custom_variable_slices_on_axis_0():
    """Failure 24: a rank-2 custom Variable stacked on 0 (L, 4, 2) mis-sliced by rank rules."""
    model = W.make_model(scanned=True, num_layers=4)
    unscanned = W.make_model(scanned=False, num_layers=4)
    table = _flat(_items(model))[("nnx_aux", "model", *LAYERS, "routing_table")]
    assert table.shape == (4, 4, 2)
    layer0 = _flat(_items(unscanned))[("nnx_aux", "model", "decoder", "layers_0", "routing_table")]
    assert not np.array_equal(_take(table, 1, 0), layer0)  # ndim >= 2 -> axis 1: wrong data
    _assert_same(unroll(_items(model), Target.from_nnx(model)), _items(unscanned))


def test_300_layers_past_the_256_cap():
    """Failure 23: the x256 replication patch; per-layer state and scalars for 300 layers."""
    target, tree = _gemma_like(300, stacked_count=False)
    keys = jax.random.split(jax.random.key(1), 300)
    abstract = {
        "params": {"params": {"decoder": {"layers": {"mlp": {"kernel": _sds((2, 300, 2))}}}}},
        "nnx_aux": {
            "model": {
                "decoder": {
                    "layers": {
                        "rngs": {
                            "params": {"count": _sds((), np.uint32), "key": _sds((), KEY)},
                            "dropout": {"count": _sds((300,), np.uint32), "key": _sds((300,), KEY)},
                        }
                    }
                }
            }
        },
    }
    target = Target.from_items(abstract)
    rngs = tree["nnx_aux"]["model"]["decoder"]["layers"]["rngs"]
    rngs["dropout"] = {"count": np.arange(300, dtype=np.uint32), "key": keys}
    flat = _flat(unroll(tree, target))
    assert len(flat) == 300 * 5
    last = ("nnx_aux", "model", "decoder", "layers_299", "rngs")
    assert int(flat[(*last, "params", "count")]) == 7
    assert int(flat[(*last, "dropout", "count")]) == 299
    assert _raw(flat[(*last, "dropout", "key")]).tobytes() == _raw(keys[299]).tobytes()
    _assert_same(stack(unroll(tree, target), target)[0], tree)
    one = _flat(unstack_layer(tree, target, 299))
    assert int(one[(*last, "dropout", "count")]) == 299


def test_a_group_holding_a_list_is_not_a_block():
    """NNX unscanned decoders keep ``layers`` as a list: ``layers/0/...`` is per layer already."""
    tree = {"decoder": {"layers": [{"kernel": np.ones((2, 3))}, {"kernel": np.zeros((2, 3))}]}}
    target = Target.from_items({"params": {"params": tree}})
    assert set(scan_axes(target).values()) == {None}
    _assert_same(unroll({"params": {"params": tree}}, target), {"params": {"params": tree}})


# -- group names ----------------------------------------------------------------------
def _arr(shape):
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def test_group_names_gemma3_blocks_deepseek_groups_and_gemma4_scanned_blocks():
    """MaxText's own unscanned names (FAMILIES_AND_SCALE): a block scan's step ``r`` of
    sub-layer ``k`` of ``B`` is ``layers_<r*B+k>``, its remainder ``layers_<n*B+j>``;
    DeepSeek's groups unroll from 0 each; gemma4's ``scanned_blocks`` unroll as ``layers``."""
    tree = {
        "params": {
            "params": {
                "decoder": {
                    "layers": {
                        f"layers_{k}": {"kernel": _arr((2, 2, 3)) + 100 * k} for k in range(2)
                    },
                    "layers_remainder": {"layers_0": {"kernel": _arr((2, 3))}},
                    "dense_layers": {"kernel": _arr((2, 2, 3))},
                    "moe_layers": {"kernel": _arr((2, 4, 3))},
                }
            }
        },
        "nnx_aux": {
            "model": {
                "decoder": {
                    "layers": {
                        "layers_0": {"rngs": {"a": {"count": np.arange(2, dtype=np.uint32)}}}
                    },
                    "layers_remainder": {"rngs": {"a": {"count": np.uint32(1)}}},
                    "moe_layers": {"rngs": {"a": {"count": np.arange(4, dtype=np.uint32)}}},
                }
            }
        },
    }
    target = Target.from_items(tree)
    axes = scan_axes(target)
    P, A = ("params", "params", "decoder"), ("nnx_aux", "model", "decoder")
    assert axes[(*P, "layers", "layers_1", "kernel")] == 1
    assert axes[(*P, "layers_remainder", "layers_0", "kernel")] is None
    assert axes[(*A, "layers_remainder", "rngs", "a", "count")] is None
    assert axes[(*P, "dense_layers", "kernel")] == 1
    assert axes[(*A, "moe_layers", "rngs", "a", "count")] == 0
    flat = _flat(unroll(tree, target))
    blocks = tree["params"]["params"]["decoder"]["layers"]
    for i in range(4):  # step r = i // 2 of sub-layer k = i % 2
        got = flat[(*P, f"layers_{i}", "kernel")]
        assert np.array_equal(got, blocks[f"layers_{i % 2}"]["kernel"][:, i // 2]), i
    assert np.array_equal(flat[(*P, "layers_4", "kernel")], _arr((2, 3)))  # the remainder
    assert int(flat[(*A, "layers_2", "rngs", "a", "count")]) == 1  # layers_0's step 1
    assert (*A, "layers_remainder", "rngs", "a", "count") in flat  # no layer: kept as is
    assert {p[3] for p in flat if p[3].startswith("moe")} == {f"moe_layers_{i}" for i in range(4)}
    assert {p[3] for p in flat if p[3].startswith("dense")} == {"dense_layers_0", "dense_layers_1"}
    assert int(flat[(*A, "moe_layers_3", "rngs", "a", "count")]) == 3
    _assert_same(stack(unroll(tree, target), target)[0], tree)
    three = _flat(unstack_layer(tree, target, 3))  # dense has 2 layers
    assert {p[3] for p in three} == {"layers_3", "moe_layers_3"}
    assert np.array_equal(three[(*P, "layers_3", "kernel")], blocks["layers_1"]["kernel"][:, 1])
    four = _flat(unstack_layer(tree, target, 4))
    assert np.array_equal(four[(*P, "layers_4", "kernel")], _arr((2, 3)))

    gemma4 = {"decoder": {"scanned_blocks": {f"layers_{k}": {"w": _arr((3, 2))} for k in range(2)}}}
    g4 = Target.from_items({"params": {"params": gemma4}})
    names = {p[3] for p in _flat(unroll({"params": {"params": gemma4}}, g4))}
    assert names == {"layers_0", "layers_1", "layers_2", "layers_3"}
    # The unscanned target: each layer's spec; and stacked back with the block map.
    flat_t = unroll_target(target)
    assert flat_t.params[("decoder", "layers_3", "kernel")].shape == (2, 3)
    assert flat_t.params[("decoder", "layers_4", "kernel")].shape == (2, 3)
    back = stack_target(flat_t, layers=layer_map(target))
    assert dict(back.params) == dict(target.params)
    assert dict(back.nnx_aux) == dict(target.nnx_aux)


def test_two_groups_unrolling_to_one_name_are_refused():
    tree = {"decoder": {"layers": {"w": _arr((3, 2))}, "scanned_blocks": {"w": _arr((3, 2))}}}
    with pytest.raises(LayoutMismatchError, match="unroll to one name"):
        layer_map(Target.from_items({"params": {"params": tree}}))


def test_layer_keys_are_parsed_one_way_for_every_group():
    """`layer_of` is the one parser of ``<group>_<i>`` keys (stack, the rescan plans and the
    planner's scan-form hint use it), so DeepSeek group names get the hint too."""
    assert layer_of("layers_0") == ("layers", 0)
    assert layer_of("moe_layers_12") == ("moe_layers", 12)
    assert layer_of("dense_layers_1") == ("dense_layers", 1)
    assert layer_of("scanned_blocks_3") == ("scanned_blocks", 3)
    for key in ("layers", "layers_", "layers_x", "layers_remainder", "mlp_0", "xlayers_0", 3):
        assert layer_of(key) is None, key
    f32 = np.dtype(np.float32)
    params = {("decoder", f"moe_layers_{i}", "w", "value"): LeafSpec((4,), f32) for i in range(2)}
    target = Target({("decoder", "moe_layers", "w"): LeafSpec((4, 2), f32)}, {})
    with pytest.raises(LayoutMismatchError) as e:
        make_plan(params, None, target, step=1)
    assert "scan form differs" in e.value.hint
    assert "unrolled (layers_<i>)" in e.value.hint


# -- stack maps through the target's paths ---------------------------------------------
def test_stack_initialises_missing_rng_and_refuses_missing_weights():
    model = W.make_model(scanned=True)
    target = Target.from_nnx(model)
    tree = _items(W.make_model(scanned=False))
    aux = tree["nnx_aux"]["model"]["decoder"]
    del aux["layers_1"]["dropout"]  # a shared stream kept at one layer only
    del aux["rngs"]["params"]  # state the unscanned model never had
    got, report = stack(tree, target, rng_seed=5)
    dropout = ("nnx_aux", "model", *LAYERS, "dropout", "rngs", "dropout")
    params = ("nnx_aux", "model", "decoder", "rngs", "params")
    assert dict(report.fresh) == {
        (*dropout, "count"): (1,),
        (*dropout, "key"): (1,),
        (*params, "count"): None,
        (*params, "key"): None,
    }
    assert "4 RNG leaves freshly initialised" in str(report)
    flat, want = _flat(got), _flat(_items(model))
    assert set(flat) == set(want)
    assert flat[(*dropout, "count")].tolist() == [0, 0, 2]  # layers 0 and 2 carried over
    keys = _raw(flat[(*dropout, "key")])
    assert _is_key(flat[(*dropout, "key")]) and _is_key(flat[(*params, "key")])
    assert np.array_equal(keys[[0, 2]], _raw(want[(*dropout, "key")])[[0, 2]])
    assert not np.array_equal(keys[1], _raw(want[(*dropout, "key")])[1])
    again = _flat(stack(tree, target, rng_seed=5)[0])[(*dropout, "key")]
    assert np.array_equal(_raw(again), keys)  # deterministic in rng_seed

    del tree["nnx_aux"]["model"]["decoder"]["layers_2"]["routing_table"]
    del tree["params"]["params"]["decoder"]["layers_0"]["mlp"]["wi"]
    tree["params"]["params"]["decoder"]["layers_3"] = {"mlp": {"wo": {"kernel": np.zeros((16, 8))}}}
    with pytest.raises(LayoutMismatchError) as e:
        stack(tree, target)
    problems = "\n".join(e.value.problems)
    assert "nnx_aux/model/decoder/layers/routing_table: layers [2] missing" in problems
    assert "params/params/decoder/layers/mlp/wi/kernel: layers [0] missing" in problems
    assert "decoder/layers_3/mlp/wo/kernel: layer 3 is beyond the target's 3 layers" in problems


def test_stack_real_unscanned_dpo_fixture_onto_maxtext_target():
    """The real unscanned model keeps its shared RNG once: 48 aux leaves vs the target's 30."""
    target = Target.from_checkpoint(MAXTEXT_NATIVE)
    tree = _restore("tunix017/dpo_run/checkpoints/1/model_params")
    got, report = stack(tree, target)
    flat = {p[1:-1]: v for p, v in _flat(got).items()}  # drop base/ and value
    assert set(flat) == target.model_paths()
    for p, spec in {**target.params, **target.nnx_aux}.items():
        assert tuple(_raw(flat[p]).shape) == spec.shape, p
    attention = (*LAYERS, "self_attention", "attention_op", "rngs")
    fresh = {p[1:-1]: v for p, v in report.fresh.items()}
    assert fresh == {
        **{
            (*attention, s, f): (1, 2)
            for s in ("aqt", "dropout", "params")
            for f in ("count", "key")
        },
        **{
            ("decoder", "rngs", s, f): None
            for s in ("aqt", "dropout", "params")
            for f in ("count", "key")
        },
    }
    src = {p[1:-1]: v for p, v in _flat(tree).items()}
    for i in range(3):
        wo = src[("decoder", f"layers_{i}", "mlp", "wo", "kernel")]
        assert (
            _raw(_take(flat[(*LAYERS, "mlp", "wo", "kernel")], 1, i)).tobytes()
            == _raw(wo).tobytes()
        )
        key = src[("decoder", f"layers_{i}", "dropout", "rngs", "dropout", "key")]
        assert (
            _raw(flat[(*LAYERS, "dropout", "rngs", "dropout", "key")][i]).tobytes()
            == _raw(key).tobytes()
        )
    shared = src[("decoder", "layers_0", "self_attention", "attention_op", "rngs", "params", "key")]
    assert _raw(flat[(*attention, "params", "key")][0]).tobytes() == _raw(shared).tobytes()


# -- the real scanned fixtures ----------------------------------------------------------
def _check_slices(tree, target, flat_unrolled) -> int:
    """Every unrolled leaf of layer i equals slice i of its stacked leaf on the model's axis."""
    axes = scan_axes(target)
    checked = 0
    for p, x in _flat(tree).items():
        # Tunix paths: drop the adapter level and the trailing Variable 'value' level.
        q = tuple(k for k in (p[:-1] if p[-1] == "value" else p) if k != "base")
        candidates = (q, ("params", "params", *q), ("nnx_aux", "model", *q))
        axis = next((axes[c] for c in candidates if c in axes), None)
        if axis is None:
            continue
        j = p.index("layers")
        for i in range(3):
            got = flat_unrolled[(*p[:j], f"layers_{i}", *p[j + 1 :])]
            assert _is_key(got) == _is_key(x), p
            assert _raw(got).tobytes() == _raw(_take(x, axis, i)).tobytes(), p
            checked += 1
    return checked


def test_maxtext_native_fixture_unrolls_against_its_own_metadata():
    target = Target.from_checkpoint(MAXTEXT_NATIVE)
    tree = _restore("maxtext_native/run/checkpoints/2/items")
    flat = _flat(unroll(tree, target))
    assert not any("layers" in p for p in flat)
    # 9 Params + 18 RNG leaves + 18 moments in the block, 3 layers each
    assert _check_slices(tree, target, flat) == (9 + 18 + 18) * 3
    assert (
        flat[
            ("nnx_aux", "model", "decoder", "layers_2", "dropout", "rngs", "dropout", "count")
        ].shape
        == ()
    )
    _assert_same(stack(unroll(tree, target), target)[0], tree)


def test_tunix_rl_fixture_unrolls_against_the_maxtext_target():
    target = Target.from_checkpoint(MAXTEXT_NATIVE)
    step = "tunix017/rl_run/checkpoints/actor/2"
    for item, n in (("model_params", 9 + 18), ("optimizer_state", 18)):
        tree = _restore(f"{step}/{item}")
        flat = _flat(unroll(tree, target))
        assert _check_slices(tree, target, flat) == n * 3
        _assert_same(stack(unroll(tree, target), target)[0], tree)


# -- unstack_layer ----------------------------------------------------------------------
def test_unstack_layer_slices_one_layer_without_copying():
    model = W.make_model(scanned=True)
    target = Target.from_nnx(model)
    items = jax.tree.map(_raw, _items(model))  # numpy, raw uint32 keys
    full = _flat(unroll(items, target))
    stacked = _flat(items)
    for i in range(3):
        one = _flat(unstack_layer(items, target, i))
        assert one and all(f"layers_{i}" in p for p in one)
        _same_leaves(one, {p: v for p, v in full.items() if f"layers_{i}" in p})
        kernel = ("params", "params", "decoder", f"layers_{i}", "mlp", "wi", "kernel")
        assert np.shares_memory(
            one[kernel], stacked[("params", "params", *LAYERS, "mlp", "wi", "kernel")]
        )
    jax_one = _flat(unstack_layer(_items(model), target, 2))  # jax arrays, typed keys
    jax_full = _flat(unroll(_items(model), target))
    _same_leaves(jax_one, {p: v for p, v in jax_full.items() if "layers_2" in p})
    for bad in (3, -1):
        with pytest.raises(IndexError):
            unstack_layer(items, target, bad)


def test_unstack_layer_reads_lazily_from_tensorstore():
    """A lazy reader (an in-memory zarr TensorStore) is sliced, not read, until asked."""
    import tensorstore as ts

    def store(values: np.ndarray):
        spec = {"driver": "zarr", "kvstore": {"driver": "memory"}}
        arr = ts.open(spec, dtype=values.dtype.name, shape=values.shape, create=True).result()
        arr.write(values).result()
        return arr

    kernel = np.arange(2 * 300 * 2, dtype=np.float32).reshape(2, 300, 2)
    count = np.arange(300, dtype=np.uint32)
    tree = {
        "params": {"params": {"decoder": {"layers": {"kernel": store(kernel)}}}},
        "nnx_aux": {"model": {"decoder": {"layers": {"rngs": {"a": {"count": store(count)}}}}}},
    }
    target = Target.from_items(
        jax.tree.map(
            lambda x: _sds(x.shape, x.dtype),
            {
                "params": {"params": {"decoder": {"layers": {"kernel": kernel}}}},
                "nnx_aux": {"model": {"decoder": {"layers": {"rngs": {"a": {"count": count}}}}}},
            },
        )
    )
    one = _flat(unstack_layer(tree, target, 299))
    got = one[("params", "params", "decoder", "layers_299", "kernel")]
    assert isinstance(got, ts.TensorStore) and got.shape == (2, 2)
    assert np.array_equal(got.read().result(), kernel[:, 299])
    c = one[("nnx_aux", "model", "decoder", "layers_299", "rngs", "a", "count")]
    assert int(c.read().result()) == 299


# -- targets ----------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1])
def test_unroll_and_stack_target_match_the_other_form(axis):
    scanned = Target.from_nnx(W.abstract_model(scanned=True, param_scan_axis=axis))
    unscanned = Target.from_nnx(W.abstract_model(scanned=False))
    unrolled = unroll_target(scanned)
    assert unrolled.params == unscanned.params and unrolled.nnx_aux == unscanned.nnx_aux
    restacked = stack_target(unscanned, param_scan_axis=axis)
    assert restacked.params == scanned.params and restacked.nnx_aux == scanned.nnx_aux
    restacked = stack_target(unrolled)
    assert restacked == _with_abstract_of(scanned, restacked)


def test_mixed_axes_targets_keep_each_params_axis():
    unscanned, scanned = _mixed_axes()
    target, flat_target = Target.from_nnx(scanned), Target.from_nnx(unscanned)
    unrolled = unroll_target(target)
    assert unrolled.params == flat_target.params and unrolled.nnx_aux == flat_target.nnx_aux
    restacked = stack_target(unrolled)  # the metadata travels with the per-layer paths
    assert restacked == _with_abstract_of(target, restacked)
    assert restacked.param_scan_axes[(*LAYERS, "mlp", "wi", "kernel")] == 2


def _with_abstract_of(want: Target, got: Target) -> Target:
    """``want`` with ``got``'s abstract leaves (those lose shardings; compared here)."""
    assert set(got.abstract) == set(want.abstract)
    for p, x in want.abstract.items():
        assert got.abstract[p].shape == x.shape and got.abstract[p].dtype == x.dtype, p
    return dataclasses.replace(want, abstract=got.abstract)


def test_targets_round_trip_on_the_maxtext_fixture_and_plan_an_unscanned_step(tmp_path):
    target = Target.from_checkpoint(MAXTEXT_NATIVE)
    unrolled = unroll_target(target)
    assert len(unrolled.params) == 3 + 9 * 3 and len(unrolled.nnx_aux) == 12 + 18 * 3
    assert len(unrolled.opt_state) == 4 + 2 * (3 + 9 * 3)
    restacked = stack_target(unrolled)
    assert restacked == _with_abstract_of(target, restacked)
    # The converter can plan an unscanned Tunix step against the unrolled target.
    model = W.make_model(scanned=False, adapter=True)
    opt = W.make_optimizer(model, "rl")
    step = W.write_tunix_step(tmp_path / "ckpt", 1, model, opt, role="actor")
    scanned = Target.from_nnx(W.abstract_model(scanned=True))
    plan = make_plan(
        read_specs(step / "model_params"),
        read_specs(step / "optimizer_state"),
        unroll_target(scanned),
    )
    assert plan.summary()["params"]["leaves"] == 12
