"""Conversion of checkpoints written in the tests the way Tunix writes them.

The oracle is the live model and optimizer that were saved: every weight, RNG
leaf and optimizer array must come back bit-identical from the converted
``items``, read with stock Orbax.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import writers as W
from conftest import stock_restore, tree_digest
from etils import epath
from flax import nnx

from orbax_maxtext_layout import (
    LayoutMismatchError,
    Target,
    convert_step,
    read_specs,
    to_maxtext_items,
)
from orbax_maxtext_layout.base.treepaths import flatten, norm_key, unflatten


def _flat(tree) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


def _raw(x) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for p in want:
        assert _raw(got[p]) == _raw(want[p]), p
        assert str(got[p].dtype) == str(want[p].dtype), p


def _live(model) -> tuple[dict, dict]:
    """(Params, other persistent state) of a live model, without any adapter level."""
    if isinstance(model, W.TunixMaxTextAdapter):
        model = model.base
    params, _, aux = nnx.state(model, nnx.Param, (nnx.Intermediate, nnx.Cache), ...)
    return _flat(params.to_pure_dict()), _flat(aux.to_pure_dict())


def _live_opt(optimizer) -> dict:
    return _flat(nnx.state(optimizer, nnx.optimizer.OptState).to_pure_dict())


def _restore(item_dir) -> dict:
    return _flat(stock_restore(item_dir))


def _sub(flat: dict, prefix: tuple) -> dict:
    n = len(prefix)
    return {p[n:]: v for p, v in flat.items() if p[:n] == prefix}


def _drop_base(flat: dict) -> dict:
    return {tuple(k for k in p if k != "base"): v for p, v in flat.items()}


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """A scanned, adapter-wrapped RL actor step after 2 updates (inject(chain(clip, adamw(schedule))))."""
    model = W.make_model(scanned=True, adapter=True)
    opt = W.make_optimizer(model, "rl")
    W.train_steps(model, opt, 2)
    root = tmp_path_factory.mktemp("rl") / "checkpoints"
    W.write_tunix_step(root, 2, model, opt, role="actor", custom_metadata={"role": "actor"})
    return root / "actor" / "2", model, opt


def _copy(step: epath.Path, tmp_path) -> epath.Path:
    import shutil

    dst = tmp_path / "actor" / step.name
    shutil.copytree(step, dst)
    return epath.Path(dst)


def test_canonical_rules_against_an_nnx_target_without_optimizer(rl_run, tmp_path):
    step, model, opt = rl_run
    step = _copy(step, tmp_path)
    target = Target.from_nnx(W.abstract_model(scanned=True))
    report = convert_step(step, target)

    got = _restore(step / "items")
    params, aux = _live(model)
    _assert_same(_sub(got, ("params", "params")), params)
    _assert_same(_sub(got, ("nnx_aux", "model")), aux)  # includes the rank-3 routing_table
    assert any(p[-1] == "routing_table" for p in aux)
    for p, v in _sub(got, ("nnx_aux", "model")).items():
        if p[-1] == "key":
            assert jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key), p

    # Canonical optimizer: inject shell peeled, chains as lists, mu/nu wrapped in params.
    live = _live_opt(opt)
    adam = _drop_base(_sub(live, ("opt_state", "inner_state", "1", "0")))
    want = {(1, 0, "count"): adam[("count",)]}
    for m in ("mu", "nu"):
        want |= {(1, 0, m, "params", *p): v for p, v in _sub(adam, (m,)).items()}
    _assert_same(_sub(got, ("opt_state",)), want)
    raw = stock_restore(step / "items")
    assert isinstance(raw["opt_state"], list) and raw["opt_state"][0] is None
    assert got[("step",)].dtype == np.int32 and int(got[("step",)]) == 2

    assert report.rules == [
        "unwrap_value",
        "drop_adapter",
        "drop_adapter_in_moments",
        "peel_multisteps",
        "peel_inject_hyperparams",
        "chain_to_list",
        "wrap_moments",
    ]
    reasons = {d["path"]: d["reason"] for d in report.dropped}
    assert set(reasons) == {
        "opt_state/count/value",
        "opt_state/hyperparams/learning_rate/value",
        "opt_state/hyperparams_states/learning_rate/count/value",
    }
    assert all("inject_hyperparams shell" in r for r in reasons.values())


def test_rl_matches_a_target_written_by_maxtext_keeping_the_inject_shell(rl_run, tmp_path):
    step, _, opt = rl_run
    step = _copy(step, tmp_path)
    bare = W.make_model(scanned=True)
    mt_opt = W.make_optimizer(bare, "rl")
    W.train_steps(bare, mt_opt, 1)
    mt_step = W.write_maxtext_step(tmp_path / "maxtext", 5, bare, mt_opt)

    report = convert_step(step, Target.from_checkpoint(mt_step))

    assert read_specs(step / "items") == read_specs(mt_step / "items")
    assert "peel_inject_hyperparams" not in report.rules
    got = _restore(step / "items")
    live = _drop_base(_sub(_live_opt(opt), ("opt_state",)))
    _assert_same(_sub(got, ("opt_state",)), live)


def _pretraining_target(model, opt_kind_has_schedule: bool = False) -> Target:
    """MaxText pre-training's shape: opt_state = [{count, mu: {params}, nu: {params}}, None, {count}]."""
    params, aux = _live(model)
    a = {p: jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in params.items()}
    count = jax.ShapeDtypeStruct((), np.int32)
    items = {("params", "params", *p): v for p, v in a.items()}
    items |= {
        ("nnx_aux", "model", *p): jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in aux.items()
    }
    items |= {("opt_state", 0, "count"): count, ("opt_state", 2, "count"): count}
    for m in ("mu", "nu"):
        items |= {("opt_state", 0, m, "params", *p): v for p, v in a.items()}
    items[("step",)] = count
    return Target.from_items(unflatten(items))


@pytest.mark.parametrize("kind", ["sft", "sft_schedule"])
def test_post_training_chain_onto_the_pretraining_optimizer(kind, tmp_path):
    model = W.make_model(scanned=True)
    opt = W.make_optimizer(model, kind)
    W.train_steps(model, opt, 1)
    step = W.write_tunix_step(tmp_path / "ck", 1, model, opt, custom_metadata={})
    report = convert_step(step, _pretraining_target(model))

    got = _restore(step / "items")
    live = _sub(_live_opt(opt), ("opt_state", "1"))
    assert _raw(got[("opt_state", 0, "count")]) == _raw(live[("0", "count")])
    assert _raw(got[("opt_state", 2, "count")]) == _raw(live[("0", "count")])
    for m in ("mu", "nu"):
        _assert_same(_sub(got, ("opt_state", 0, m, "params")), _sub(live, ("0", m)))
    assert "select_chain_member[1]" in report.rules
    synthesized = "synthesize_schedule_count" in report.rules
    assert synthesized is (kind == "sft")  # with a schedule lr the count exists


def test_rl_onto_the_pretraining_optimizer_uses_the_known_mapping(rl_run, tmp_path):
    step, model, opt = rl_run
    step = _copy(step, tmp_path)
    report = convert_step(step, _pretraining_target(model.base))
    assert report.rules[-4:] == [
        "select_chain_member[1]",
        "top_chain_to_list",  # one chain level: MaxText's non-recursive form suffices
        "wrap_moments",
        "synthesize_schedule_count",
    ]
    got = _restore(step / "items")
    adam = _drop_base(_sub(_live_opt(opt), ("opt_state", "inner_state", "1", "0")))
    assert _raw(got[("opt_state", 2, "count")]) == _raw(adam[("count",)])
    _assert_same(_sub(got, ("opt_state", 0, "nu", "params")), _sub(adam, ("nu",)))


def test_an_optimizer_with_no_unambiguous_match_is_refused(rl_run, tmp_path):
    step, model, _ = rl_run
    step = _copy(step, tmp_path)
    target = _pretraining_target(model.base)
    # Same tree, but bf16 moments: no rule may change a dtype, so no candidate matches.
    opt = {
        p: jax.ShapeDtypeStruct(s.shape, np.dtype("bfloat16") if "mu" in p else s.dtype)
        for p, s in ((p, s.abstract()) for p, s in target.opt_state.items())
    }
    bad = Target.from_items(
        unflatten({**target.abstract, **{("opt_state", *p): v for p, v in opt.items()}})
    )
    before = tree_digest(step)
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, bad)
    assert "optimizer='drop'" in str(e.value)
    assert len(e.value.problems) == 6  # each bf16 mu leaf, by name
    assert all("/mu/params/" in p and "target expects bfloat16" in p for p in e.value.problems)
    assert tree_digest(step) == before
    assert convert_step(step, bad, optimizer="drop").status == "converted"


def test_multisteps_shell_is_peeled_and_the_accumulator_reported(tmp_path):
    model = W.make_model(scanned=True)
    opt = W.make_optimizer(model, "multisteps")
    W.train_steps(model, opt, 1)
    step = W.write_tunix_step(tmp_path / "ck", 1, model, opt)
    report = convert_step(step, Target.from_nnx(W.abstract_model(scanned=True)))
    assert {"peel_multisteps", "peel_inject_hyperparams"} <= set(report.rules)
    acc = [d for d in report.dropped if d["path"].startswith("opt_state/acc_grads/")]
    assert len(acc) == len(_live(model)[0])
    assert all("MultiSteps shell" in d["reason"] for d in acc)
    got = _restore(step / "items")
    live = _sub(_live_opt(opt), ("opt_state", "inner_opt_state", "inner_state", "1", "0"))
    _assert_same(_sub(got, ("opt_state", 1, 0, "mu", "params")), _sub(live, ("mu",)))


def test_unscanned_model_against_unscanned_target(tmp_path):
    model = W.make_model(scanned=False)
    opt = W.make_optimizer(model, "sft")
    W.train_steps(model, opt, 1)
    step = W.write_tunix_step(tmp_path / "ck", 1, model, opt)
    convert_step(step, Target.from_nnx(W.abstract_model(scanned=False)))
    got = _restore(step / "items")
    params, aux = _live(model)
    _assert_same(_sub(got, ("params", "params")), params)
    _assert_same(_sub(got, ("nnx_aux", "model")), aux)


def test_sown_intermediates_are_dropped_and_unknown_leaves_refused(tmp_path):
    model = W.add_intermediate(W.make_model(scanned=True))
    step = W.write_tunix_step(tmp_path / "ck", 3, model)
    target = Target.from_nnx(W.abstract_model(scanned=True, custom_var=False))
    before = tree_digest(step)
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, target)
    # routing_table is unknown to this target; it must not be routed to nnx_aux.
    assert e.value.problems == [
        "decoder/layers/routing_table/value: not in the target model (int32[3, 4, 2])"
    ]
    assert tree_digest(step) == before

    report = convert_step(step, target, ignore=["*/routing_table"])
    reasons = {d["path"]: d["reason"] for d in report.dropped}
    assert set(reasons) == {
        "decoder/max_logits/value/0",
        "decoder/layers/max_logits/value/0",
        "decoder/layers/routing_table/value",
    }
    # No optimizer_state: the step comes from the directory name, and the report says so.
    assert report.step == 3 and report.step_source == "directory name"
    assert _restore(step / "items")[("step",)] == np.int32(3)


def test_a_real_base_module_is_not_mistaken_for_the_adapter(tmp_path):
    model = W.make_model(scanned=True, adapter=True)
    step = W.write_tunix_step(tmp_path / "ck", 1, model)
    report = convert_step(step, Target.from_nnx(W.abstract_model(scanned=True, adapter=True)))
    assert "drop_adapter" not in report.rules
    assert all(p[2] == "base" for p in read_specs(step / "items") if p[0] == "params")


def test_wrong_size_lists_every_weight_and_writes_nothing(tmp_path):
    model = W.make_model(scanned=True)
    step = W.write_tunix_step(tmp_path / "ck", 1, model)
    before = tree_digest(step)
    with pytest.raises(LayoutMismatchError) as e:
        convert_step(step, Target.from_nnx(W.abstract_model(scanned=True, emb=16)))
    assert len(e.value.problems) == len(_live(model)[0])  # every Param has an emb dimension
    assert all("target expects float32" in p for p in e.value.problems)
    assert tree_digest(step) == before


def test_to_maxtext_items_equals_convert_step(rl_run, tmp_path):
    step, _, _ = rl_run
    step = _copy(step, tmp_path)
    target = Target.from_nnx(W.abstract_model(scanned=True))
    items = to_maxtext_items(
        stock_restore(step / "model_params"),
        stock_restore(step / "optimizer_state"),
        target,
    )
    convert_step(step, target)
    _assert_same(_flat(items), _restore(step / "items"))


@pytest.mark.parametrize("kind", ["sft", "rl", "multisteps"])
def test_optimizer_matches_maxtext_non_recursive_linen_form(kind, tmp_path):
    """MaxText keeps nested chains as int-keyed dicts: the result must too, not lists."""
    model = W.make_model(scanned=True, adapter=kind == "rl")
    opt = W.make_optimizer(model, kind)
    W.train_steps(model, opt, 1)
    step = W.write_tunix_step(tmp_path / "ck", 1, model, opt)
    abstract_opt = nnx.eval_shape(lambda: W.make_optimizer(W.make_model(scanned=True), kind))
    target = Target.from_nnx(W.abstract_model(scanned=True), optimizer=abstract_opt)
    report = convert_step(step, target)
    assert "chain_to_list" not in report.rules
    raw_tree = stock_restore(step / "items")
    want = W.opt_state_to_linen(nnx.state(opt, nnx.optimizer.OptState).to_pure_dict()["opt_state"])
    if kind == "rl":  # adapter level dropped inside the moments too
        want = _drop_base_tree(want)
    # Same containers (list vs dict) at every level, and the same values.
    assert _shape_of(raw_tree["opt_state"]) == _shape_of(want)
    _assert_same(_flat(raw_tree["opt_state"]), _flat(want))


def _shape_of(node):
    if isinstance(node, dict):
        return {str(k): _shape_of(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_shape_of(v) for v in node]
    return None if node is None else "leaf"


def _drop_base_tree(node):
    if isinstance(node, dict):
        if set(node) == {"base"}:
            return _drop_base_tree(node["base"])
        return {k: _drop_base_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_drop_base_tree(v) for v in node]
    return node
