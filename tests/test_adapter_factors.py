"""LoRA factors carried through linear hooks onto PEFT's factors (`adapter_factors`): per
hook, per kernel axis, and the refusal of hooks that cannot be split onto the factors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orbax_maxtext_layout.lora.adapter_factors import TOLERANCE, carry, check
from orbax_maxtext_layout.lora.delta import lora_delta_added

EMB, HEADS, HD, R = 12, 3, 8, 4


def _delta(kernel: tuple[int, ...]):
    return lambda a, b: lora_delta_added(np.zeros(kernel, np.float64), a, b, 1.0)


def _query_hook(x):  # llama's query: depth scaling, RoPE's row order, (out, in)
    x = x * math.sqrt(HD)
    x = x.reshape(EMB, HEADS, HD // 2, 2).transpose(0, 1, 3, 2).reshape(EMB, HEADS * HD)
    return x.T


def _out_hook(x):  # attention out (heads, head_dim, emb): (emb, heads * head_dim)
    return x.reshape(HEADS * HD, EMB).T


def _mlp_hook(x):  # a plain dense kernel (emb, mlp): its transpose
    return x.T


def _row_scaled_hook(x):  # a different constant per output row (and per input column)
    return (x * np.arange(1, x.shape[1] + 1)[None, :] * np.arange(2, x.shape[0] + 2)[:, None]).T


CASES = {  # kernel, its hook, qwix's (in, out) split of the kernel (contracting dims first)
    "query": ((EMB, HEADS, HD), _query_hook, (EMB, HEADS * HD)),
    "out": ((HEADS, HD, EMB), _out_hook, (HEADS * HD, EMB)),
    "mlp": ((EMB, 20), _mlp_hook, (EMB, 20)),
    "scaled": ((EMB, 20), _row_scaled_hook, (EMB, 20)),
}


def _factors(split, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((split[0], R)).astype(np.float32)
    b = rng.standard_normal((R, split[1])).astype(np.float32)
    return a, b


@pytest.mark.parametrize("name", list(CASES))
def test_carried_factors_give_the_hooked_delta(name):
    kernel, hook, split = CASES[name]
    a, b = _factors(split, 0)
    delta = _delta(kernel)
    fmap = carry(hook, delta, a.shape[0], b.shape[1])
    assert not isinstance(fmap, str), fmap
    lora_a, lora_b = fmap.peft(a, b)
    want = hook(lora_delta_added(np.zeros(kernel, np.float64), a, b, 1.0))
    assert lora_a.shape == (R, want.shape[1]) and lora_b.shape == (want.shape[0], R)
    assert lora_a.dtype == np.float32 and lora_b.dtype == np.float32
    top = np.abs(want).max()
    np.testing.assert_allclose(lora_b.astype(np.float64) @ lora_a, want, rtol=0, atol=1e-6 * top)
    assert check(hook, delta, fmap, a, b) <= TOLERANCE
    # another layer's factors through the same map (the map is the module's, not the layer's)
    a2, b2 = _factors(split, 1)
    assert check(hook, delta, fmap, a2, b2) <= TOLERANCE


def test_the_query_map_is_a_permutation_and_the_depth_scale():
    kernel, hook, _ = CASES["query"]
    fmap = carry(hook, _delta(kernel), EMB, HEADS * HD)
    assert not isinstance(fmap, str)
    assert sorted(fmap.out_index.tolist()) == list(range(HEADS * HD))
    assert fmap.out_index.tolist() != list(range(HEADS * HD))  # RoPE's rows moved
    np.testing.assert_allclose(fmap.in_scale * fmap.out_scale[0], math.sqrt(HD), rtol=1e-6)


@pytest.mark.parametrize(
    "hook, why",
    [
        (lambda x: (x + x[::-1]).T, "do not act on"),  # mixes two input entries
        (lambda x: np.cumsum(x, axis=1).T, "do not act on"),  # mixes output entries
        (lambda x: (x + 1.0).T, "do not act on"),  # affine, not linear
        (lambda x: x.T[:, :-1], "one to one"),  # loses an input entry
        (lambda x: np.stack([x.T, x.T]), "not a matrix"),
        (lambda x: x, "do not act on"),  # the input side on the rows
    ],
    ids=["mix-in", "mix-out", "affine", "lossy", "3d", "swapped"],
)
def test_a_hook_that_cannot_be_split_is_refused(hook, why):
    kernel = (EMB, 20)
    got = carry(hook, _delta(kernel), EMB, 20)
    assert isinstance(got, str) and why in got, got


def test_check_catches_a_map_that_does_not_hold():
    """A hook whose probes pass but which mixes entries elsewhere: the layer check fails."""
    kernel = (EMB, 20)

    def sneaky(x):
        y = x.T.copy()
        y[5, 7] += x[3, 2]  # an entry the probes (entry 0 on each side) never see moved
        return y

    fmap = carry(sneaky, _delta(kernel), EMB, 20)
    assert not isinstance(fmap, str)
    a, b = _factors((EMB, 20), 0)
    assert check(sneaky, _delta(kernel), fmap, a, b) > TOLERANCE


def test_the_peft_target_pattern_selects_exactly_the_adapted_modules():
    import re

    from orbax_maxtext_layout.hf.export_adapter import target_pattern

    lm = "model.language_model.layers"
    names = {f"{lm}.{i}.self_attn.{p}" for i in range(12) for p in ("q_proj", "k_proj")}
    names |= {f"{lm}.{i}.mlp.down_proj" for i in (0, 6)} | {"lm_head"}
    pattern = target_pattern(names)
    assert all(re.fullmatch(pattern, n) for n in names)
    # what bare suffixes would also select: gemma3's vision tower, layers not adapted
    for other in (
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
        f"{lm}.1.mlp.down_proj",
        f"{lm}.12.self_attn.q_proj",
        f"{lm}.0.self_attn.q_proj.base_layer",
        "xlm_head",
    ):
        assert not re.fullmatch(pattern, other), other


# -- MoE experts: qwix's einsum factors cut per expert (export_adapter.factor_cut) ---------
E, L, MLP = 3, 2, 10


def _expert_factor(kernel, a_shape, b_shape, axis):
    from orbax_maxtext_layout.model.lora import delta_layouts, per_layer_shape
    from orbax_maxtext_layout.orbax_io.spec import LeafSpec
    from orbax_maxtext_layout.plan.moves import LoraFactor

    layouts = delta_layouts(
        per_layer_shape(kernel, axis),
        per_layer_shape(a_shape, axis),
        per_layer_shape(b_shape, axis),
    )
    assert len(layouts) == 1, layouts
    f32 = np.dtype(np.float32)
    return LoraFactor(
        "model_params", ("a",), ("b",), LeafSpec(a_shape, f32), LeafSpec(b_shape, f32),
        axis, 1.0, layouts[0],
    )  # fmt: skip


def _unit(levels):
    from orbax_maxtext_layout.hf.hf_mapping import Unit

    if not levels:
        return Unit(("w",), None, None, "x.weight", None)
    (axis, index), *more = levels
    return Unit(("w",), index, axis, "x.weight", None, tuple(more))


EXPERT_CASES = {  # kernel, a, b, the factors' layer axis, each unit's levels (as MaxText cuts)
    # wi_0 (experts, layers, emb, mlp): a (emb, layers, r) shared, b (r, layers, experts, mlp)
    "wi_0": ((E, L, EMB, MLP), (EMB, L, R), (R, L, E, MLP), 1),
    # wo (experts, layers, mlp, emb): a (experts, layers, mlp, r), b (r, layers, emb) shared
    "wo": ((E, L, MLP, EMB), (E, L, MLP, R), (R, L, EMB), 1),
    "wi_0 unscanned": ((E, EMB, MLP), (EMB, R), (R, E, MLP), None),
}


@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_each_experts_factors_give_its_slice_of_the_merge(name):
    from orbax_maxtext_layout.hf.export_adapter import factor_cut

    kernel, a_shape, b_shape, axis = EXPERT_CASES[name]
    f = _expert_factor(kernel, a_shape, b_shape, axis)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    for layer in range(L) if axis is not None else [None]:
        a_l = a if axis is None else np.take(a, layer, axis=axis)
        b_l = b if axis is None else np.take(b, layer, axis=axis)
        per_layer = tuple(d for k, d in enumerate(kernel) if k != axis)
        merged = lora_delta_added(np.zeros(per_layer), a_l, b_l, 1.0, layout=f.layout)
        for e in range(E):
            levels = [(0, e)] if axis is None else [(0, e), (0, layer)]
            cut = factor_cut(f, kernel, _unit(levels))
            assert not isinstance(cut, str), cut
            a_u, b_u = cut.take(a, b, axis)
            assert a_u.shape[1] == R and b_u.shape[0] == R  # rank r: nothing stacked
            np.testing.assert_allclose((a_u @ b_u).reshape(merged[e].shape), merged[e])


def test_expert_factors_that_do_not_cut_per_expert_are_refused():
    from orbax_maxtext_layout.hf.export_adapter import factor_cut

    # one Hugging Face tensor holding every expert of a layer (a fused 3-D export)
    f = _expert_factor(*EXPERT_CASES["wi_0"])
    got = factor_cut(f, EXPERT_CASES["wi_0"][0], _unit([(1, 0)]))
    assert isinstance(got, str) and "holds all its experts" in got, got
    # an expert kernel stored (experts, mlp, emb) with a (emb, r), b (r, experts, mlp): an
    # expert's slice is the transpose of a @ b[:, e], not its reshape
    f = _expert_factor((E, MLP, EMB), (EMB, R), (R, E, MLP), None)
    got = factor_cut(f, (E, MLP, EMB), _unit([(0, 1)]))
    assert isinstance(got, str) and "do not reshape" in got, got
