"""Interop: google-tunix 0.1.7 writes, orbax-maxtext-layout converts, maxtext 0.2.5 reads.

See docs/interop.md for what each check proves and how to rerun this suite. Every
import below is a hard requirement: if google-tunix or maxtext cannot be imported the
module fails to collect, with the import error as the reason (nothing is skipped).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import interop_support as S
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx
from maxtext.common import checkpointing as mcp
from maxtext.common import train_state_nnx as tsn
from orbax.checkpoint.experimental.v1 import errors as ocp_errors

import orbax_maxtext_layout as oml

CASES = {
    # name: Tunix producer settings
    "sft_scanned": dict(scanned=True, optimizer_kind="sft"),
    "sft_unscanned": dict(scanned=False, optimizer_kind="sft"),
    "sft_schedule_scanned": dict(scanned=True, optimizer_kind="sft_schedule"),
    "dpo_adapter_unscanned": dict(scanned=False, adapter=True, optimizer_kind="sft"),
    "dpo_adapter_scanned": dict(scanned=True, adapter=True, optimizer_kind="sft"),
    "rl_actor": dict(scanned=True, adapter=True, optimizer_kind="rl", role="actor", steps=(1, 2)),
    "rl_actor_unscanned": dict(scanned=False, adapter=True, optimizer_kind="rl", role="actor"),
    "distill_multisteps": dict(scanned=True, optimizer_kind="multisteps", steps=(2,)),
    "model_only": dict(scanned=True, optimizer_kind=None),
    "lora_only": dict(scanned=True, lora=True, optimizer_kind="sft"),
    "lora_only_unscanned": dict(scanned=False, lora=True, optimizer_kind="sft"),
}
CONCURRENT_GB = 1


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="module")
def runs(workdir):
    """Each case written once by Tunix; converted and pristine copies are made from it."""
    cache: dict[str, S.TunixRun] = {}

    def get(case: str) -> S.TunixRun:
        if case not in cache:
            cache[case] = S.write_tunix_run(workdir / "tunix", case, **CASES[case])
        return cache[case]

    return get


def abstract_train_state(run: S.TunixRun) -> nnx.State:
    """MaxText's restore target: ``nnx.state(TrainStateNNX(model, optimizer))``, abstract.

    The model is the bare (MaxText-side) tiny model; MaxText 0.2.5's loaders need only its
    state, not a MaxText model config.
    """

    def build():
        model = S.make_model(scanned=run.scanned, lora=run.lora)
        opt = (
            S.make_optimizer(model, run.optimizer_kind, lora=run.lora)
            if run.optimizer_kind
            else None
        )
        return tsn.TrainStateNNX(model, opt)

    return nnx.state(nnx.eval_shape(build))


def library_target(run: S.TunixRun) -> oml.Target:
    """`Target.from_nnx` of the test model, with the optimizer MaxText itself expects.

    ``opt_state`` is what MaxText's ``to_checkpoint_dict`` makes of the abstract
    optimizer, so the converted ``items`` must match MaxText's own save layout.
    """
    abstract = S.abstract_model(scanned=run.scanned, lora=run.lora)
    model_state = nnx.state(abstract, nnx.LoRAParam) if run.lora else abstract
    opt_state = None
    if run.optimizer_kind:
        opt_state = tsn.to_checkpoint_dict(abstract_train_state(run))["opt_state"]
    return oml.Target.from_nnx(model_state, opt_state=opt_state)


@pytest.fixture(scope="module")
def converted(runs, workdir):
    """A copy of each Tunix run, every step converted in place with this library."""
    cache: dict[tuple[str, str], S.TunixRun] = {}

    def get(case: str, optimizer: str = "convert") -> S.TunixRun:
        if (case, optimizer) not in cache:
            run = runs(case)
            dst = workdir / f"converted-{optimizer}" / case
            shutil.copytree(run.root, dst)
            target = library_target(run)
            infos = oml.find_steps(dst)
            assert sorted(i.step for i in infos) == sorted(run.steps)
            for info in infos:
                report = oml.convert_step(info.path, target, optimizer=optimizer)
                assert report.status == "converted", report
                assert oml.detect_layout(info.path) is oml.Layout.MAXTEXT
            cache[case, optimizer] = S.TunixRun(**{**run.__dict__, "root": dst})
        return cache[case, optimizer]

    return get


def pristine(run: S.TunixRun, dst: Path) -> S.TunixRun:
    """A fresh, unconverted copy of a Tunix run."""
    shutil.copytree(run.root, dst)
    return S.TunixRun(**{**run.__dict__, "root": dst})


def linen_params(run: S.TunixRun) -> dict:
    """Abstract Linen params collection ``{"params": {...}}`` of the bare model."""
    abstract = S.abstract_model(scanned=run.scanned, lora=run.lora)
    return {"params": nnx.state(abstract, nnx.LoRAParam if run.lora else nnx.Param).to_pure_dict()}


def nnx_params(run: S.TunixRun) -> nnx.State:
    abstract = S.abstract_model(scanned=run.scanned, lora=run.lora)
    return nnx.state(abstract, nnx.LoRAParam if run.lora else nnx.Param)


# -------------------------------------------------- (1) load_params_from_path, bit-identical


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_maxtext_load_params_from_path_reads_converted_weights(case, form, converted):
    run = converted(case)
    want = run.steps[max(run.steps)]["params"]
    abstract = linen_params(run) if form == "linen" else nnx_params(run)
    got = mcp.load_params_from_path(str(run.step_dir() / "items"), abstract, CONCURRENT_GB)
    if form == "linen":
        assert isinstance(got, dict) and set(got) == {"params"}
        got = got["params"]
    else:
        assert isinstance(got, nnx.State)
    S.assert_bit_identical(S.flat(got), want, f"{case}: params via load_params_from_path ({form})")


# ------------------------------------ (2) resume through MaxText's own checkpoint manager


def _restore_config(run: S.TunixRun):
    """The only MaxText config fields 0.2.5's resume path reads, for a LoRA run.

    ``load_state_if_possible`` reads ``maxtext_config.enable_diloco`` and
    ``maxtext_config.lora.enable_lora`` (via ``getattr``); a full pyconfig needs a MaxText
    model config, which this suite does not build (see docs/interop.md).
    """
    if not run.lora:
        return None
    return SimpleNamespace(enable_diloco=False, lora=SimpleNamespace(enable_lora=True))


@pytest.mark.parametrize("case", list(CASES))
def test_maxtext_resume_restores_converted_run(case, converted):
    _resume_and_check(converted(case))


@pytest.mark.parametrize("case", [c for c, kw in CASES.items() if kw["optimizer_kind"]])
def test_maxtext_resume_restores_params_aux_step_with_optimizer_dropped(case, converted):
    """``optimizer="drop"``: MaxText's resume restores weights, nnx_aux and step; the
    optimizer keeps its init (MaxText's checkpointer loads with ``partial_load=True``)."""
    _resume_and_check(converted(case, "drop"), optimizer_dropped=True)


def _resume_and_check(run: S.TunixRun, *, optimizer_dropped: bool = False) -> None:
    manager = mcp.create_orbax_checkpoint_manager(
        str(run.root), enable_checkpointing=True, use_async=False, save_interval_steps=1
    )
    try:
        assert mcp.latest_step(manager) == max(run.steps)
        assert sorted(mcp.all_steps(manager)) == sorted(run.steps)
        for step in sorted(run.steps):
            restored, params_only = mcp.load_state_if_possible(
                manager,
                None,
                "",
                "",
                CONCURRENT_GB,
                abstract_train_state(run),
                step=step,
                maxtext_config=_restore_config(run),
            )
            assert params_only is None
            _check_restored_state(run, step, restored["items"], optimizer_dropped)
    finally:
        manager.close()


def _check_restored_state(
    run: S.TunixRun, step: int, state: nnx.State, optimizer_dropped: bool = False
) -> None:
    want = run.steps[step]
    got_model = S.flat(state["model"])
    kinds = {
        tuple(S.norm(k) for k in p): v
        for p, v in nnx.to_flat_state(state["model"])
        if isinstance(v, nnx.Variable)
    }
    params = {p: x for p, x in got_model.items() if p in want["params"]}
    S.assert_bit_identical(params, want["params"], f"{run.name}@{step}: params")
    if run.lora:
        # MaxText's LoRA resume restores only adapter weights and step; the base weights
        # and RNG state keep the model's own init (see docs/interop.md).
        assert all(isinstance(kinds[p], nnx.LoRAParam) for p in params)
    else:
        aux = {p: x for p, x in got_model.items() if p not in want["params"]}
        S.assert_bit_identical(aux, want["nnx_aux"], f"{run.name}@{step}: nnx_aux")
        for p, x in aux.items():
            if p[-1] == "key":
                assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key), p
    if run.optimizer_kind is None:
        return
    got_opt = S.flat(state["optimizer"])
    got_step = got_opt.pop(("step",))
    assert np.asarray(got_step).tobytes() == np.asarray(want["step"]).tobytes()
    assert got_step.dtype == want["step"].dtype and int(got_step) == step
    got_opt = {p[1:]: x for p, x in got_opt.items() if p[:1] == ("opt_state",)}
    if optimizer_dropped:
        assert set(got_opt) == set(want["opt_state"])
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in got_opt.values())
        return
    if run.lora:
        # MaxText 0.2.5's LoRA restore target keeps only paths naming "lora" or "step";
        # the Linen opt_state list is dropped whole, so the optimizer keeps its init.
        assert set(got_opt) == set(want["opt_state"])
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in got_opt.values())
        return
    S.assert_bit_identical(got_opt, want["opt_state"], f"{run.name}@{step}: opt_state")


@pytest.mark.parametrize("case", [c for c, kw in CASES.items() if kw["optimizer_kind"]])
def test_converted_opt_state_bytes_equal_tunix_optimizer(case, converted):
    """Independent of MaxText's loader: every optimizer leaf, read back with stock Orbax
    (no target, so container kinds do not matter), equals Tunix's optimizer bit for bit."""
    run = converted(case)
    for step, want in run.steps.items():
        items = ocp.PyTreeCheckpointHandler().restore(epath.Path(run.step_dir(step) / "items"))
        got = S.flat(items)
        S.assert_bit_identical(
            {p[1:]: x for p, x in got.items() if p[:1] == ("opt_state",)},
            want["opt_state"],
            f"{case}@{step}: opt_state read with stock Orbax",
        )
        assert got[("step",)].dtype == np.int32 and int(got[("step",)]) == int(want["step"])


# ----------------------------------------------- (3) MaxText sees the step's custom metadata


@pytest.mark.parametrize("case", ["rl_actor", "sft_scanned", "lora_only"])
def test_maxtext_load_checkpoint_metadata_sees_step_metadata(case, converted):
    run = converted(case)
    for step in run.steps:
        step_dir = run.step_dir(step)
        on_disk = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
        for path in (step_dir, step_dir / "items"):
            meta = mcp.load_checkpoint_metadata(str(path))
            assert meta == on_disk
            for k, v in run.custom_metadata[step].items():  # Tunix's own entries survive
                assert meta[k] == v
            assert meta["orbax_maxtext_layout"]["source_layout"] == "tunix"
    if case == "rl_actor":
        assert mcp.load_checkpoint_metadata(str(run.step_dir(2)))["role"] == "actor"


# ----------------------------- (4) reverse: unconverted Tunix items defeat MaxText's loader


REVERSE_CASES = ["rl_actor", "sft_unscanned"]


@pytest.mark.parametrize("case", REVERSE_CASES)
@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_maxtext_model_params_branch_rejects_tunix_item_in_place(case, form, runs, tmp_path):
    """0.2.5's ``model_params`` branch on ``<step>/model_params``: Orbax v1 refuses the item.

    The step directory carries ``_CHECKPOINT_METADATA``, so the item is not a checkpoint
    of its own; the step directory itself has no ``items``.
    """
    run = pristine(runs(case), tmp_path / "raw")
    step_dir = run.step_dir()
    abstract = linen_params(run) if form == "linen" else nnx_params(run)
    with pytest.raises(ocp_errors.InvalidLayoutError, match="Could not recognize the checkpoint"):
        mcp.load_params_from_path(str(step_dir / "model_params"), abstract, CONCURRENT_GB)
    for path in (step_dir, step_dir / "items"):
        with pytest.raises(ocp_errors.InvalidLayoutError):
            mcp.load_params_from_path(str(path), abstract, CONCURRENT_GB)


@pytest.mark.parametrize("case", REVERSE_CASES)
@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_maxtext_model_params_branch_on_detached_item(case, form, runs, tmp_path):
    """The same item copied out of its step (so Orbax v1 accepts it as a pytree).

    Abstract target: every weight is reported missing. Concrete target: MaxText returns
    the target's own init weights without an error, none of the checkpoint's.
    """
    run = runs(case)
    item = tmp_path / "detached" / "model_params"
    shutil.copytree(run.step_dir() / "model_params", item)
    want = run.steps[max(run.steps)]["params"]

    abstract = linen_params(run) if form == "linen" else nnx_params(run)
    with pytest.raises(ValueError, match="Checkpoint does not match the model") as err:
        mcp.load_params_from_path(str(item), abstract, CONCURRENT_GB)
    for p in want:
        assert f"{'/'.join(p)}': missing" in str(err.value), p

    init = S.make_model(scanned=run.scanned, seed=123)
    concrete_state = nnx.state(init, nnx.Param)
    init_flat = {p: np.array(x) for p, x in S.flat(concrete_state).items()}
    concrete = {"params": concrete_state.to_pure_dict()} if form == "linen" else concrete_state
    got = mcp.load_params_from_path(str(item), concrete, CONCURRENT_GB)
    got = S.flat(got["params"] if form == "linen" else got)
    S.assert_bit_identical(got, init_flat, f"{case}: detached load returns init weights")
    assert all(S.raw(got[p]) != S.raw(want[p]) for p in want)


@pytest.mark.parametrize("case", REVERSE_CASES)
def test_maxtext_resume_on_unconverted_run_fails(case, runs, tmp_path):
    run = pristine(runs(case), tmp_path / "raw")
    manager = mcp.create_orbax_checkpoint_manager(
        str(run.root), enable_checkpointing=True, use_async=False, save_interval_steps=1
    )
    try:
        assert mcp.latest_step(manager) == max(run.steps)
        with pytest.raises(KeyError, match=r"\['items'\]\) for loading were not found") as err:
            mcp.load_state_if_possible(
                manager, None, "", "", CONCURRENT_GB, abstract_train_state(run)
            )
        assert "Available checkpointables: ['model_params', 'optimizer_state']" in str(err.value)
    finally:
        manager.close()


@pytest.mark.parametrize("case", REVERSE_CASES)
@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_library_reads_and_converts_what_maxtext_cannot(case, form, runs, tmp_path):
    """Ours on the same raw item succeeds; after `convert_step`, MaxText's loader does too."""
    run = pristine(runs(case), tmp_path / "raw")
    step_dir = run.step_dir()
    want = run.steps[max(run.steps)]["params"]
    for path in (step_dir / "model_params", step_dir):
        abstract = linen_params(run) if form == "linen" else nnx_params(run)
        got = oml.load_params_from_path(path, abstract)
        got = S.flat(got["params"] if form == "linen" else got)
        S.assert_bit_identical(got, want, f"{case}: orbax_maxtext_layout.load_params_from_path")

    oml.convert_step(step_dir, library_target(run))
    abstract = linen_params(run) if form == "linen" else nnx_params(run)
    got = mcp.load_params_from_path(str(step_dir / "items"), abstract, CONCURRENT_GB)
    got = S.flat(got["params"] if form == "linen" else got)
    S.assert_bit_identical(got, want, f"{case}: MaxText after convert_step")


# ----------------------------------------------------------- the producer really is Tunix


def test_tunix_wrote_the_documented_layout(runs):
    run = runs("rl_actor")
    assert run.root.name == "actor"
    for step in run.steps:
        step_dir = run.step_dir(step)
        assert sorted(p.name for p in step_dir.iterdir()) == [
            "_CHECKPOINT_METADATA",
            "commit_success.txt",
            "model_params",
            "optimizer_state",
        ]
        meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        assert meta["custom_metadata"] == {"global_step": step + 1, "role": "actor"}
        assert oml.detect_layout(step_dir) is oml.Layout.TUNIX
    lora = runs("lora_only")
    specs = oml.read_specs(lora.step_dir() / "model_params")
    assert specs and all(p[-2] in ("kernel_lora_a", "kernel_lora_b") for p in specs), sorted(specs)
