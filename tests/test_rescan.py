"""``convert --unroll`` / ``--stack``: the other scan form, written from the real fixtures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import writers as W
from conftest import (
    FIXTURES,
    MAXTEXT_NATIVE,
    RL_ACTOR_STEPS,
    copy_fixture,
    raw,
    restore_flat,
    stock_restore,
    tree_digest,
)
from test_cli import cli

from orbax_maxtext_layout import (
    LayoutMismatchError,
    LeafSpec,
    Target,
    convert_step,
    read_specs,
    scan_axes,
    stack,
    stack_target,
    unroll_target,
    verify_step,
)
from orbax_maxtext_layout.base.treepaths import flatten


def _full(t: Target) -> dict:
    out = {("params", "params", *p): s for p, s in t.params.items()}
    out |= {("nnx_aux", "model", *p): s for p, s in t.nnx_aux.items()}
    return out | {("opt_state", *p): s for p, s in (t.opt_state or {}).items()}


def test_unroll_writes_the_unscanned_tree_slicing_each_leaf_on_its_own_axis(tmp_path):
    scanned = Target.from_checkpoint(MAXTEXT_NATIVE)
    target = unroll_target(scanned)
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    before = tree_digest(step, exclude=("_CHECKPOINT_METADATA",))
    report = convert_step(step, target, rescan="unroll")
    assert "unroll" in report.rules
    assert read_specs(step / "items") == _full(target) | {
        ("step",): LeafSpec((), np.dtype("int32"))
    }
    converted = convert_step(copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path / "b"), scanned)
    assert converted.status == "converted"
    stacked = restore_flat(tmp_path / "b" / RL_ACTOR_STEPS["tunix017_rl"] / "items")
    got = restore_flat(step / "items")
    axes = scan_axes(scanned)
    checked = 0
    for p, x in stacked.items():
        a = axes.get(p)
        if a is None:
            assert raw(got[p]).tobytes() == raw(x).tobytes(), p
            continue
        for i in range(3):  # Params on axis 1, RNG counts (L,) and keys (L, 2) on axis 0
            q = tuple(f"layers_{i}" if k == "layers" else k for k in p)
            assert raw(got[q]).tobytes() == np.take(raw(x), i, axis=a).tobytes(), q
            checked += 1
    assert checked == 3 * (9 + 18 + 9 + 9)  # params, RNG, mu, nu leaves in the block
    for p, x in got.items():
        if p[-1] == "key":
            assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key), p
    assert tree_digest(step, exclude=("_CHECKPOINT_METADATA", "items")) == before


def test_stack_writes_the_scanned_tree_and_reports_fresh_rng(tmp_path):
    target = Target.from_checkpoint(MAXTEXT_NATIVE).without_optimizer()
    step = copy_fixture("tunix017/dpo_run/checkpoints/1", tmp_path)
    report = convert_step(step, target, rescan="stack", optimizer="drop")
    want = {p: s for p, s in read_specs(MAXTEXT_NATIVE / "items").items() if p[0] != "opt_state"}
    assert read_specs(step / "items") == want
    fresh = [n for n in report.notes if "initialised fresh" in n]
    # The unscanned model stores the attention RNG once (layer 0) and has no decoder/rngs.
    assert len(fresh) == 12 + 6
    src = restore_flat(step / "model_params")
    got = restore_flat(step / "items")
    for i in range(3):
        w = src[("base", "decoder", f"layers_{i}", "mlp", "wo", "kernel", "value")]
        assert np.array_equal(
            np.asarray(got[("params", "params", "decoder", "layers", "mlp", "wo", "kernel")])[
                :, i, :
            ],
            np.asarray(w),
        )
    c0 = src[
        (
            "base",
            "decoder",
            "layers_0",
            "self_attention",
            "attention_op",
            "rngs",
            "aqt",
            "count",
            "value",
        )
    ]
    stacked = got[
        (
            "nnx_aux",
            "model",
            "decoder",
            "layers",
            "self_attention",
            "attention_op",
            "rngs",
            "aqt",
            "count",
        )
    ]
    assert int(stacked[0]) == int(c0) and list(np.asarray(stacked[1:])) == [0, 0]


def test_stack_reports_fresh_rng_when_the_unscanned_form_is_maxtexts_own(tmp_path):
    """A target whose unscanned form is MaxText's own model (`Target.twin`, what
    ``--maxtext-config`` builds) holds a shared RNG stream at ``layers_0`` only and no
    ``decoder/rngs``: nothing is missing against it, yet the stack initialises the other
    layers' copies and ``decoder/rngs`` fresh. The report lists them as it does against the
    unrolled checkpoint target, and the items are the same."""
    scanned = Target.from_checkpoint(MAXTEXT_NATIVE).without_optimizer()
    unrolled = unroll_target(scanned)
    src = FIXTURES / "tunix017/dpo_run/checkpoints/1/model_params"
    held = {p[1:-1] for p in read_specs(src)}  # without the adapter's base/ and the value level
    own = {p: s for p, s in unrolled.nnx_aux.items() if p in held}
    assert len(unrolled.nnx_aux) - len(own) == 12 + 6  # layers 1, 2 attention RNG; decoder/rngs
    twin = dataclasses.replace(unrolled, nnx_aux=own)
    reports, items = {}, {}
    for name, target in (("derived", scanned), ("twin", dataclasses.replace(scanned, twin=twin))):
        step = copy_fixture("tunix017/dpo_run/checkpoints/1", tmp_path / name)
        reports[name] = convert_step(step, target, rescan="stack", optimizer="drop")
        items[name] = restore_flat(step / "items")
    fresh = {n: {x for x in r.notes if "initialised fresh" in x} for n, r in reports.items()}
    assert len(fresh["derived"]) == 12 + 6
    assert fresh["twin"] == fresh["derived"]
    assert sorted(items["twin"]) == sorted(items["derived"])
    for p, x in items["derived"].items():
        assert raw(items["twin"][p]).tobytes() == raw(x).tobytes(), p


def _stacked_in_memory(step, target: Target, **kwargs) -> tuple[dict, dict]:
    """`stack` of the step's model_params, read as stored (typed keys), keyed by items path."""
    tree = stock_restore(step / "model_params")
    got, report = stack(tree, target, **kwargs)

    def items_path(p: tuple) -> tuple:
        model = tuple(k for k in p if k != "base")[:-1]  # Tunix: base/ adapter, value level
        return (
            ("params", "params", *model) if model in target.params else ("nnx_aux", "model", *model)
        )

    flat = flatten(got, is_leaf=lambda x: hasattr(x, "dtype"))
    return {items_path(p): x for p, x in flat.items()}, {
        items_path(p): v for p, v in report.fresh.items()
    }


@pytest.mark.parametrize("source", ["dpo_fixture", "no_layer_dropout"])
def test_stack_in_memory_and_convert_stack_initialise_the_same_rng(source, tmp_path):
    """One derivation of fresh RNG state: what `convert --stack` writes for RNG the unscanned
    checkpoint lacks is what `stack` gives in memory, bit for bit and typed alike.

    The real unscanned DPO step keeps the attention RNG at layer 0 only and has no
    decoder/rngs; the writers step has no per-layer dropout RNG at all (a whole stacked
    leaf initialised fresh)."""
    if source == "dpo_fixture":
        target = Target.from_checkpoint(MAXTEXT_NATIVE).without_optimizer()
        step = copy_fixture("tunix017/dpo_run/checkpoints/1", tmp_path)
        want_fresh = 12 + 6  # 6 RNG leaves in layers 1 and 2, 6 decoder/rngs leaves
    else:
        target = Target.from_nnx(W.abstract_model(scanned=True))
        step = W.write_tunix_step(tmp_path, 1, W.make_model(scanned=False, dropout=False))
        want_fresh = 6  # count and key of 3 layers
    report = convert_step(step, target, rescan="stack", optimizer="drop")
    assert len([n for n in report.notes if "initialised fresh" in n]) == want_fresh
    on_disk = restore_flat(step / "items")
    del on_disk[("step",)]  # from the directory name: not in model_params

    in_memory, fresh = _stacked_in_memory(step, target)

    assert sorted(in_memory) == sorted(on_disk)
    assert {p[-1] for p in fresh} == {"count", "key"}
    for p, x in on_disk.items():  # the fresh leaves, and every leaf carried over
        assert in_memory[p].dtype == x.dtype, p
        assert raw(in_memory[p]).tobytes() == raw(x).tobytes(), p
    assert verify_step(step).ok
    # rng_seed changes only the fresh keys.
    seeded, _ = _stacked_in_memory(step, target, rng_seed=5)
    for p, x in on_disk.items():
        same = raw(seeded[p]).tobytes() == raw(x).tobytes()
        assert same == (p not in fresh or p[-1] == "count"), p


def test_unroll_with_the_wrong_model_is_refused(tmp_path):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    target = unroll_target(Target.from_checkpoint(MAXTEXT_NATIVE), num_layers=None)
    bad = Target(
        {p: s for p, s in target.params.items() if "wo" not in p},
        target.nnx_aux,
        target.opt_state,
        abstract={k: v for k, v in target.abstract.items() if "wo" not in k},
    )
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, bad, rescan="unroll", optimizer="drop")
    assert any("wo" in p for p in e.value.problems)
    assert not (step / "items").exists()


def test_cli_unroll_on_the_shipped_example(tmp_path):
    import shutil

    from orbax_maxtext_layout import EXAMPLES_DIR

    run = tmp_path / "run"
    shutil.copytree(EXAMPLES_DIR / "tunix_rl_run", run)
    target = tmp_path / "unscanned.py"
    target.write_text(
        "import orbax_maxtext_layout as o\n"
        "def target():\n"
        f"    return o.unroll_target(o.Target.from_checkpoint({str(EXAMPLES_DIR / 'maxtext_run/checkpoints/2')!r}))\n"
    )
    res = cli(
        "convert",
        str(run / "checkpoints"),
        "--target",
        "unscanned:target",
        "--unroll",
        "--json",
        "--keep-step-numbers",
        env={"PYTHONPATH": str(tmp_path)},
    )
    (report,) = json.loads(res.stdout)
    assert report["status"] == "converted" and "unroll" in report["rules"]
    assert ("params", "params", "decoder", "layers_2", "mlp", "wo", "kernel") in read_specs(
        run / "checkpoints/actor/2/items"
    )


# -- MaxText 0.2.5's own unscanned model: one RNG stream for all layers, kept in layers_0 --
MT025 = FIXTURES / "maxtext025"
SFT_STEP = "maxtext025/sft_run/checkpoints/2"


def _mt025(run: str) -> Path:
    [step] = sorted((MT025 / run / "checkpoints").iterdir())[-1:]
    return step


def test_stack_target_of_maxtexts_unscanned_model_is_its_scanned_models_layer_state():
    """MaxText's unscanned model stores its attention RNG once (``layers_0``); stacked, it is
    the scanned model's per-layer state (its nnx_aux alone would say one layer)."""
    unscanned = Target.from_checkpoint(_mt025("pretrain_unscanned_run"))
    scanned = Target.from_checkpoint(_mt025("pretrain_run"))
    assert [p for p in unscanned.nnx_aux if p[1] != "layers_0"] == []  # stored once
    stacked = stack_target(unscanned)
    assert stacked.params == scanned.params
    # the same per-layer RNG state; only the scanned model has decoder/rngs
    assert stacked.nnx_aux == {p: s for p, s in scanned.nnx_aux.items() if p[1] != "rngs"}


def test_unroll_of_maxtexts_sft_state_against_its_unscanned_model(tmp_path):
    """``convert --unroll`` of MaxText's scanned SFT state against MaxText's unscanned
    target: layer 0's RNG state goes to ``layers_0``, the other layers' is dropped with the
    reason, and the step replays (`verify`)."""
    target = Target.from_checkpoint(_mt025("pretrain_unscanned_run"))
    step = copy_fixture(SFT_STEP, tmp_path)
    report = convert_step(step, target, rescan="unroll")
    assert report.status == "converted", report.notes
    got = read_specs(step / "items")
    assert {p[2:] for p in got if p[:2] == ("nnx_aux", "model")} == set(target.nnx_aux)
    assert {p[2:] for p in got if p[:2] == ("params", "params")} == set(target.params)
    shared = [d for d in report.dropped if "shares one RNG stream" in d["reason"]]
    assert sorted({d["path"].rsplit("/", 1)[1] for d in shared}) == [
        "[scan step 1: layers_1]",
        "[scan step 2: layers_2]",
    ]
    assert len(shared) == 2 * 6  # layers 1 and 2 of the six attention RNG leaves
    # each dropped layer counts its own bytes: a count is 4, a (4,) unsafe_rbg key 16
    assert sorted({d["bytes"] for d in shared}) == [4, 16]
    src = restore_flat(step / "model_params")
    out = restore_flat(step / "items")
    for p in target.nnx_aux:
        stacked = ("decoder", "layers", *p[2:], "value")
        assert raw(out[("nnx_aux", "model", *p)]).tobytes() == raw(src[stacked])[0].tobytes()
    assert verify_step(step).ok
