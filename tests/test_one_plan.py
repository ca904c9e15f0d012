"""One plan for every conversion: what a dry run reports is what is written, scan changes
verify, and the handler and the managers restore through one core."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import (
    MAXTEXT_NATIVE,
    RL_ACTOR_STEPS,
    copy_fixture,
    raw,
    restore_flat,
    stock_restore,
)
from etils import epath

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import flatten, norm_key, unflatten
from orbax_maxtext_layout.storage.store import store_for

RL = RL_ACTOR_STEPS["tunix017_rl"]  # scanned, inject(chain(clip, adamw)), actor/2
DPO = "tunix017/dpo_run/checkpoints/1"  # unscanned, base/ adapter
MODEL_ONLY = "tunix_snapshot_v1/sft_model_only/checkpoints/1"  # scanned, no optimizer_state
SECTIONS = {"params": 2, "nnx_aux": 2, "opt_state": 1, "step": 1}


def _scanned() -> oml.Target:
    return oml.Target.from_checkpoint(MAXTEXT_NATIVE)


def _unscanned_model_only(tmp_path):
    step = copy_fixture(DPO, tmp_path)
    shutil.rmtree(step / "optimizer_state")
    return step


CASES = {
    # name: (fixture, how to get it, target, convert_step kwargs)
    "plain": (RL, _scanned, {}),
    "unroll": (RL, lambda: oml.unroll_target(_scanned()), {"rescan": "unroll"}),
    "unroll-drop": (
        RL,
        lambda: oml.unroll_target(_scanned()),
        {"rescan": "unroll", "optimizer": "drop"},
    ),
    "stack-drop": (DPO, _scanned, {"rescan": "stack", "optimizer": "drop"}),
    "model-only-unroll": (MODEL_ONLY, lambda: oml.unroll_target(_scanned()), {"rescan": "unroll"}),
    "model-only-stack": (None, _scanned, {"rescan": "stack"}),
}


def _step(name, tmp_path):
    rel = CASES[name][0]
    return _unscanned_model_only(tmp_path) if rel is None else copy_fixture(rel, tmp_path)


def _written(item_dir) -> dict[str, dict[str, int]]:
    """Leaves and bytes per section, as stock Orbax reads the written item back."""
    out = {s: {"leaves": 0, "bytes": 0} for s in SECTIONS}
    for p, x in restore_flat(item_dir).items():
        out[p[0]]["leaves"] += 1
        out[p[0]]["bytes"] += raw(x).nbytes
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_reports_exactly_what_is_written(name, tmp_path):
    step = _step(name, tmp_path)
    _, make_target, kwargs = CASES[name]
    target = make_target()
    dry = oml.convert_step(step, target, dry_run=True, **kwargs)
    assert not (step / "items").exists()
    report = oml.convert_step(step, target, **kwargs)
    assert report.status == "converted"
    reported = {s: dry.destinations[s] for s in SECTIONS}
    assert reported == _written(step / "items")
    assert report.destinations == dry.destinations
    # Every leaf the plan names exists with the planned spec, and nothing else.
    plan = oml.replay_plan(step)
    assert oml.read_specs(step / "items") == {m.dst: m.out_spec for m in plan.moves}


@pytest.mark.parametrize("name", ["model-only-unroll", "model-only-stack"])
def test_model_only_steps_take_step_from_the_directory(name, tmp_path):
    step = _step(name, tmp_path)
    _, make_target, kwargs = CASES[name]
    report = oml.convert_step(step, make_target(), **kwargs)
    assert report.step_source == "directory name" and report.step == 1
    got = restore_flat(step / "items")
    assert int(got[("step",)]) == 1 and got[("step",)].dtype == np.int32
    assert not any(p[0] == "opt_state" for p in got)


@pytest.mark.parametrize("name", ["unroll", "stack-drop", "unroll-drop"])
def test_scan_changes_verify_and_then_legacy_items_are_removed(name, tmp_path):
    step = _step(name, tmp_path)
    _, make_target, kwargs = CASES[name]
    oml.convert_step(step, make_target(), **kwargs)
    prov = oml.converted_provenance(step)
    assert prov["scan"] == kwargs["rescan"] and prov["scan_axes"]
    result = oml.verify_step(step)
    assert result.ok, result.problems
    assert result.checked == len(oml.replay_plan(step).moves) > 0
    assert oml.verify_step(step, quick=True).ok
    # A rerun with --remove-legacy finishes the job once items/ verifies.
    again = oml.convert_step(step, make_target(), remove_legacy=True, **kwargs)
    assert any("removed legacy" in n for n in again.notes), again.notes
    assert not (step / "model_params").exists()


def test_a_removal_killed_between_the_two_set_asides_is_finished_by_a_rerun(tmp_path):
    """Both legacy items were verified before the first was set aside: a rerun finishes
    the removal (it cannot verify against an item already gone, and must not keep the
    other one forever)."""
    from orbax_maxtext_layout.execute.legacy_removal import REMOVING, remove_legacy

    step = copy_fixture(RL, tmp_path)
    oml.convert_step(step, oml.unroll_target(_scanned()), rescan="unroll", optimizer="drop")
    (step / "model_params").rename(step / f"model_params{REMOVING}")  # the kill's state
    notes = remove_legacy(epath.Path(step), store=store_for(step))
    assert not (step / "optimizer_state").exists(), notes
    assert not any(p.name.endswith(REMOVING) for p in step.iterdir())
    assert any("removed legacy optimizer_state" in n for n in notes), notes
    assert oml.detect_layout(step) is oml.Layout.MAXTEXT
    assert restore_flat(step / "items")  # items intact and readable


def test_verify_after_a_scan_change_compares_values(tmp_path):
    """The same tree, one other value: verify must compare values, not just the tree."""
    step = copy_fixture(RL, tmp_path)
    oml.convert_step(step, oml.unroll_target(_scanned()), rescan="unroll", optimizer="drop")
    assert oml.verify_step(step).ok
    # Re-save the legacy model_params with stock Orbax, one weight changed.
    tree = stock_restore(step / "model_params")
    kernel = tree["base"]["decoder"]["layers"]["mlp"]["wo"]["kernel"]
    kernel["value"] = kernel["value"] + 1
    shutil.rmtree(step / "model_params")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=False)) as ckptr:
        ckptr.save(step.resolve() / "model_params", args=ocp.args.PyTreeSave(tree))
    result = oml.verify_step(step)
    assert not result.ok
    differ = [p for p in result.problems if "value differs" in p]
    assert differ and all("mlp/wo/kernel" in p for p in differ), result.problems
    assert len(differ) == 3  # the three layer slices of the one changed array


def test_cli_verify_and_remove_legacy_after_stack(tmp_path):
    from test_cli import cli

    step = copy_fixture(DPO, tmp_path / "run")
    root = tmp_path / "run" / "tunix017" / "dpo_run" / "checkpoints"
    common = ["--target-from", str(MAXTEXT_NATIVE), "--stack", "--optimizer", "drop"]
    common.append("--keep-step-numbers")
    cli("convert", str(root), *common)
    res = cli("verify", str(root))
    assert f"{step}: ok" in res.stdout, res.stdout
    cli("convert", str(root), *common, "--remove-legacy")
    assert not (step / "model_params").exists() and (step / "items").exists()


# -- one restore core --------------------------------------------------------------------
def _pretraining_target() -> oml.Target:
    """MaxText pre-training's optimizer: [{count, mu: {params}, nu: {params}}, None, {count}]."""
    t = _scanned()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def placed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)

    items = {p: placed(x) for p, x in t.abstract.items() if p[0] in ("params", "nnx_aux")}
    count = jax.ShapeDtypeStruct((), np.int32, sharding=one)
    items |= {("opt_state", 0, "count"): count, ("opt_state", 2, "count"): count}
    for m in ("mu", "nu"):
        items |= {
            ("opt_state", 0, m, "params", *p[2:]): placed(x)
            for p, x in t.abstract.items()
            if p[0] == "params"
        }
    items[("step",)] = count
    return oml.Target.from_items(unflatten(items))


def _flat(tree) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


def _by_handler(step, item):
    ckptr = ocp.Checkpointer(oml.MaxTextLayoutHandler())
    return ckptr.restore(step, args=oml.MaxTextLayoutRestore(item=item))


def _by_manager(step, item):
    with oml.CheckpointManager(step.parent, item_names=("items",), migrate="off") as m:
        args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=item))
        return m.restore(int(step.name) - 1, args=args)["items"]


@pytest.mark.parametrize("request_kind", ["params-only", "full"])
def test_handler_and_manager_return_the_same_leaves(request_kind, tmp_path):
    step = copy_fixture(RL, tmp_path)
    target = _pretraining_target()
    item = target.items()
    if request_kind == "params-only":
        item = {"params": item["params"]}
    a, b = _flat(_by_handler(step, item)), _flat(_by_manager(step, item))
    assert set(a) == set(b) == set(_flat(item))
    for p in a:
        assert raw(a[p]).tobytes() == raw(b[p]).tobytes(), p
        assert a[p].dtype == b[p].dtype, p
    assert not (step / "items").exists()


def test_restored_leaves_are_distinct_buffers_a_donating_jit_accepts(tmp_path):
    step = copy_fixture(RL, tmp_path)
    target = _pretraining_target()
    state = _by_manager(step, target.items())
    leaves = jax.tree.leaves(state)
    # The schedule count is synthesized from the Adam count: one source, two leaves.
    assert raw(state["opt_state"][0]["count"]) == raw(state["opt_state"][2]["count"])
    assert len({id(x) for x in leaves}) == len(leaves)
    pointers = [x.unsafe_buffer_pointer() for x in leaves if isinstance(x, jax.Array)]
    assert len(set(pointers)) == len(pointers)
    donating = jax.jit(lambda s: jax.tree.map(lambda x: x, s), donate_argnums=0)
    out = donating(state)  # fails with "donate the same buffer twice" on shared leaves
    assert len(jax.tree.leaves(out)) == len(leaves)


# -- errors ------------------------------------------------------------------------------
def test_errors_share_one_base_and_usage_errors_are_their_own_class(tmp_path):
    for cls in (
        oml.LayoutMismatchError,
        oml.CheckpointReadError,
        oml.UsageError,
        oml.StepLocked,
        oml.ReadOnlyStepError,
    ):
        assert issubclass(cls, oml.OrbaxMaxTextLayoutError)
    step = copy_fixture(RL, tmp_path)
    with pytest.raises(oml.UsageError):
        oml.convert_step(step, _scanned(), rescan="unroll", in_place=True)
    with pytest.raises(oml.UsageError):
        oml.CheckpointManager(step.parent, migrate="sometimes")


def test_a_zarr_format_change_converts_bit_identically_and_verifies(tmp_path):
    """``use_zarr3`` other than the source's: every array is decoded and written again, as
    one chunk, and its array metadata records that chunking. (The fixture's arrays are one
    chunk already, so the last check cannot tell the source's chunking from the new one.)"""
    a = copy_fixture(RL, tmp_path / "a")  # zarr2
    b = copy_fixture(RL, tmp_path / "b")
    report = oml.convert_step(a, _scanned(), use_zarr3=True)
    assert "re-encoded as zarr3" in report.notes
    oml.convert_step(b, _scanned())
    got, want = restore_flat(a / "items"), restore_flat(b / "items")
    assert set(got) == set(want)
    for p, x in want.items():
        assert raw(got[p]).tobytes() == raw(x).tobytes() and got[p].dtype == x.dtype, p
    meta = json.loads((a / "items" / "_METADATA").read_text())
    assert meta["use_zarr3"] is True
    arrays = json.loads((a / "items" / "array_metadatas" / "process_0").read_text())
    for entry in arrays["array_metadatas"]:
        am = entry["array_metadata"]
        assert am["chunk_shape"] == am["write_shape"], am["param_name"]
    assert oml.verify_step(a).ok
