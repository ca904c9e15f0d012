"""The layer map: which subtrees are scans, and every layer's name in both forms.

The trees are MaxText 0.2.5's own (FAMILIES_AND_SCALE, measured with its abstract models in
tests/interop/test_families.py): llama's plain scan, gemma3's block scan with a remainder,
deepseek's two groups. Each map is read three ways (shapes and axes, `infer`; the two forms'
paths, `from_forms`; an unscanned tree alone, `plain`) and checked against the unscanned
form (`check`).
"""

from __future__ import annotations

import pytest

from orbax_maxtext_layout import LayoutMismatchError
from orbax_maxtext_layout.model import layermap as LM

D = ("decoder",)


def _gemma3(steps: int = 2, remainder: int = 2) -> tuple[dict, dict]:
    """(scanned, unscanned) ``{model path: (shape, axis)}`` of a gemma3-like model."""
    scanned = {("token_embedder", "embedding"): ((64, 8), 1)}
    for k in range(6):
        scanned[(*D, "layers", f"layers_{k}", "mlp", "wo", "kernel")] = ((16, steps, 8), 1)
    scanned[(*D, "layers", "layers_0", "rngs", "params", "count")] = ((steps,), 0)
    for j in range(remainder):
        scanned[(*D, "layers_remainder", f"layers_{j}", "mlp", "wo", "kernel")] = ((16, 8), 1)
    scanned[(*D, "layers_remainder", "rngs", "params", "count")] = ((), 0)
    unscanned = {("token_embedder", "embedding"): (64, 8)}
    for i in range(6 * steps + remainder):
        unscanned[(*D, f"layers_{i}", "mlp", "wo", "kernel")] = (16, 8)
    return scanned, unscanned


def test_a_block_scan_and_its_remainder_unroll_to_maxtext_s_names():
    scanned, unscanned = _gemma3()
    lm = LM.infer(scanned)
    assert lm.describe() == [
        "decoder/layers: 2 scan steps, blocks of 6 sub-layers -> decoder/layers_<i>",
        "decoder/layers_remainder/layers_0: stored per layer -> decoder/layers_12",
        "decoder/layers_remainder/layers_1: stored per layer -> decoder/layers_13",
    ]
    # step r of sub-layer k is layer r*6+k
    names = {(la.stacked[-1], la.index): la.unrolled[-1] for la in lm.layers}
    assert names[("layers_4", 1)] == "layers_10"
    assert names[("layers_4", 0)] == "layers_4"
    assert names[("layers_1", None)] == "layers_13"
    assert lm.stacked_prefix((*D, "layers", "layers_3", "mlp", "wo", "kernel")) == (
        *D,
        "layers",
        "layers_3",
    )
    assert lm.stacked_prefix((*D, "layers_remainder", "rngs", "params", "count")) is None
    found = lm.find_unrolled(("params", "params", *D, "layers_10", "mlp", "wo", "kernel"))
    assert found is not None and found[0] == 2 and found[1].stacked[-1] == "layers_4"
    assert lm.past_end((*D, "layers_14", "mlp")) == (14, 14)
    # The same map from the two forms' paths alone, and it checks against the unscanned form.
    assert LM.from_forms(scanned, unscanned) == lm
    shapes = {p: s for p, (s, _) in scanned.items() if "rngs" not in p}
    axes = {p: a for p, (_, a) in scanned.items()}
    LM.check(lm, shapes, unscanned, axes)


def test_check_names_every_weight_the_forms_do_not_share():
    scanned, unscanned = _gemma3()
    del unscanned[(*D, "layers_13", "mlp", "wo", "kernel")]
    unscanned[(*D, "layers_3", "mlp", "wo", "kernel")] = (16, 9)
    unscanned[(*D, "layers_20", "mlp", "wo", "kernel")] = (16, 8)
    shapes = {p: s for p, (s, _) in scanned.items() if "rngs" not in p}
    with pytest.raises(LayoutMismatchError) as e:
        LM.check(LM.infer(scanned), shapes, unscanned, {p: a for p, (_, a) in scanned.items()})
    problems = "\n".join(e.value.problems)
    assert "-> decoder/layers_13/mlp/wo/kernel: not in the unscanned model" in problems
    assert "the unscanned model has [16, 9]" in problems
    assert "decoder/layers_20/mlp/wo/kernel: in the unscanned model, reached by no" in problems


def test_deepseek_groups_unroll_from_zero_each_and_a_plain_read_is_per_group():
    scanned = {
        (*D, "dense_layers", "mlp", "kernel"): ((4, 1, 4), 1),
        (*D, "moe_layers", "MoeBlock_0", "wi_0"): ((3, 2, 4, 5), 1),
    }
    lm = LM.infer(scanned)
    assert [la.unrolled for la in lm.layers] == [
        (*D, "dense_layers_0"),
        (*D, "moe_layers_0"),
        (*D, "moe_layers_1"),
    ]
    unscanned = [(*D, "dense_layers_0", "mlp"), (*D, "moe_layers_1", "w"), (*D, "moe_layers_0")]
    assert LM.plain(unscanned) == lm
    assert LM.from_forms(scanned, unscanned) == lm


def test_a_plain_read_of_an_unscanned_block_model_is_not_its_block_scan():
    """Unscanned names alone cannot tell gemma3's blocks: `plain` reads one scan of 14."""
    _, unscanned = _gemma3()
    assert LM.plain(unscanned).describe() == [
        "decoder/layers: 14 scan steps, one layer a step -> decoder/layers_<i>"
    ]


def test_forms_that_do_not_fill_the_blocks_are_refused():
    scanned, unscanned = _gemma3()
    unscanned.pop((*D, "layers_13", "mlp", "wo", "kernel"))  # 13 layers, 2 in the remainder
    with pytest.raises(LayoutMismatchError, match="do not fill its blocks of 6"):
        LM.from_forms(scanned, unscanned)


def test_scan_lengths_that_disagree_are_named():
    scanned, _ = _gemma3()
    scanned[(*D, "layers", "layers_1", "mlp", "wo", "kernel")] = ((16, 3, 8), 1)
    with pytest.raises(LayoutMismatchError, match="disagree on the scan length"):
        LM.infer(scanned)
    assert LM.infer(scanned, lengths=False).scans[0].path == (*D, "layers")


@pytest.mark.parametrize(
    ("paths", "form"),
    [
        ([(*D, "layers", "layers_0", "w"), (*D, "layers_remainder", "layers_0", "w")], True),
        ([("base", *D, "layers", "mlp", "kernel", "value")], True),
        ([(*D, "layers_0", "w"), (*D, "layers_1", "w")], False),
        ([(*D, "layers", 0, "w")], False),  # NNX's unscanned list
        ([("token_embedder", "embedding")], None),
    ],
)
def test_scanned_form_of_a_tree(paths, form):
    assert LM.scanned_form(paths) is form
