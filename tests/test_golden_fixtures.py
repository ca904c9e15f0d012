"""The real fixtures (written by google-tunix 0.1.7, the v1 Tunix writer and MaxText)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import (
    MAXTEXT_NATIVE,
    RL_ACTOR_STEPS,
    SFT_STEPS,
    copy_fixture,
    raw,
    restore_flat,
    tree_digest,
)

from orbax_maxtext_layout import (
    Layout,
    LayoutMismatchError,
    Target,
    convert_step,
    converted_provenance,
    detect_layout,
    read_specs,
)


def _expected_items(step_dir) -> dict:
    """The test oracle, written independently of the library's rules.

    model_params/base/<p>/value -> params/params/<p> (weights) or nnx_aux/model/<p>
    (anything with an 'rngs' level); optimizer_state keeps the inject shell, with
    'base' removed after mu/nu and every trailing 'value' removed.
    """
    out = {}
    for p, v in restore_flat(step_dir / "model_params").items():
        assert p[-1] == "value" and p[0] == "base"
        model_path = p[1:-1]
        root = ("nnx_aux", "model") if "rngs" in model_path else ("params", "params")
        out[root + model_path] = v
    for p, v in restore_flat(step_dir / "optimizer_state").items():
        assert p[-1] == "value"
        p = p[:-1]
        if p == ("step",):
            out[p] = v
            continue
        out[tuple(k for i, k in enumerate(p) if not (k == "base" and p[i - 1] in ("mu", "nu")))] = v
    return out


@pytest.mark.parametrize("name", sorted(RL_ACTOR_STEPS))
def test_rl_actor_steps_convert_to_the_maxtext_tree_bit_identically(name, tmp_path, maxtext_target):
    step = copy_fixture(RL_ACTOR_STEPS[name], tmp_path)
    before = tree_digest(step, exclude=("_CHECKPOINT_METADATA",))
    meta_before = json.loads((step / "_CHECKPOINT_METADATA").read_text())

    report = convert_step(step, maxtext_target)

    assert report.status == "converted"
    assert detect_layout(step) is Layout.MAXTEXT
    # The converted tree equals the target's tree: paths, stored shapes, dtypes, key impls.
    assert read_specs(step / "items") == read_specs(MAXTEXT_NATIVE / "items")
    # Every value is bit-identical to the source, and keys are typed.
    got = restore_flat(step / "items")
    want = _expected_items(step)
    assert set(got) == set(want)
    for p, v in want.items():
        assert raw(got[p]).tobytes() == raw(v).tobytes(), p
        if p[-1] == "key":
            assert jax.dtypes.issubdtype(got[p].dtype, jax.dtypes.prng_key), p
    assert got[("step",)].dtype == np.int32
    assert int(got[("step",)]) == int(want[("step",)])
    # Legacy items untouched; custom metadata kept, provenance added beside it.
    assert tree_digest(step, exclude=("_CHECKPOINT_METADATA", "items")) == before
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    for k, v in meta_before["custom_metadata"].items():
        assert meta["custom_metadata"][k] == v
    prov = converted_provenance(step)
    assert prov["source_layout"] == "tunix"
    assert "drop_adapter" in prov["rules"]
    assert report.destinations["params"]["leaves"] == 12
    assert report.destinations["nnx_aux"]["leaves"] == 30
    assert report.destinations["opt_state"]["leaves"] == 28


def test_zarr_format_follows_the_source(tmp_path, maxtext_target):
    v0 = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    v1 = copy_fixture(RL_ACTOR_STEPS["v1_rl"], tmp_path)
    convert_step(v0, maxtext_target)
    convert_step(v1, maxtext_target)
    assert json.loads((v0 / "items" / "_METADATA").read_text())["use_zarr3"] is False
    assert json.loads((v1 / "items" / "_METADATA").read_text())["use_zarr3"] is True


@pytest.mark.parametrize("name", sorted(SFT_STEPS))
def test_sft_optimizer_is_refused_then_dropped_on_request(name, tmp_path, maxtext_target):
    step = copy_fixture(SFT_STEPS[name], tmp_path)
    before = tree_digest(step)
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, maxtext_target)
    assert "optimizer='drop'" in str(e.value)
    assert "opt_state/inner_state/1/0/count" in str(e.value)
    assert tree_digest(step) == before  # nothing written

    report = convert_step(step, maxtext_target, optimizer="drop")
    assert report.destinations["opt_state"]["leaves"] == 0
    assert report.destinations["dropped"]["leaves"] == 25
    assert {d["reason"] for d in report.dropped} == {"optimizer='drop'"}
    got = read_specs(step / "items")
    want = {p: s for p, s in read_specs(MAXTEXT_NATIVE / "items").items() if p[0] != "opt_state"}
    assert got == want


def test_dry_run_writes_nothing_and_reports(tmp_path, maxtext_target):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    before = tree_digest(step)
    report = convert_step(step, maxtext_target, dry_run=True)
    assert tree_digest(step) == before
    assert report.status == "dry-run"
    assert report.destinations["params"] == {"leaves": 12, "bytes": 39360}
    assert report.step == 2 and report.step_source.startswith("optimizer_state/step")


def test_converted_step_is_skipped(tmp_path, maxtext_target):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    convert_step(step, maxtext_target)
    before = tree_digest(step)
    assert convert_step(step, maxtext_target).status == "skipped"
    assert tree_digest(step) == before


def test_unscanned_dpo_against_scanned_target_is_refused_with_every_path(tmp_path, maxtext_target):
    step = copy_fixture("tunix017/dpo_run/checkpoints/1", tmp_path)
    before = tree_digest(step)
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, maxtext_target)
    msg = str(e.value)
    assert "scan" in msg
    # Every unscanned leaf the target lacks and every scanned leaf the checkpoint
    # lacks is named: 78 source leaves and 42 target leaves, 9 of them shared.
    src = {p[1:-1] for p in read_specs(step / "model_params")}
    tgt = {p[2:] for p in read_specs(MAXTEXT_NATIVE / "items") if p[0] in ("params", "nnx_aux")}
    assert len(src) == 78 and len(tgt) == 42 and len(src & tgt) == 9
    assert len(e.value.problems) == len(src ^ tgt) == 102
    assert "base/decoder/layers_2/mlp/wo/kernel/value: not in the target" in msg
    assert "decoder/layers/mlp/wo/kernel: expected by the target" in msg
    assert tree_digest(step) == before


def _renamed(target: Target, old: str, new: str) -> Target:
    items = {
        tuple(new if k == old else k for k in p): s.abstract()
        for p, s in read_specs(MAXTEXT_NATIVE / "items").items()
    }
    from orbax_maxtext_layout.paths import unflatten

    return Target.from_items(unflatten(items))


def test_wrong_model_names_are_all_listed(tmp_path, maxtext_target):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    before = tree_digest(step)
    wrong = _renamed(maxtext_target, "mlp", "feed_forward")
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, wrong)
    # 3 mlp kernels + 6 mlp RNG leaves, each unknown and each missing.
    assert len(e.value.problems) == 18
    assert all("mlp" in p or "feed_forward" in p for p in e.value.problems)
    assert tree_digest(step) == before
    assert not (step / "items").exists()


def test_wrong_size_same_names_lists_every_shape(tmp_path):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    before = tree_digest(step)
    from orbax_maxtext_layout.paths import unflatten

    items = {}
    for p, s in read_specs(MAXTEXT_NATIVE / "items").items():
        a = s.abstract()
        if p[:2] == ("params", "params") and 16 in a.shape:  # emb 16 -> 32
            a = jax.ShapeDtypeStruct(tuple(32 if d == 16 else d for d in a.shape), a.dtype)
        items[p] = a
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, Target.from_items(unflatten(items)), optimizer="drop")
    assert len(e.value.problems) == 12  # every weight has an emb-16 dimension
    assert all("checkpoint has float32" in p and "target expects" in p for p in e.value.problems)
    assert tree_digest(step) == before
