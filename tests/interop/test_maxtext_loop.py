"""End to end: MaxText 0.2.5's real ``train`` main resumes Tunix runs (issue 11).

Every MaxText run is a subprocess of ``maxtext.trainers.pre_train.train`` on CPU, for the tiny
model of tests/fixtures/maxtext025 (synthetic data, ``checkpoint_period=1``,
``async_checkpointing=false``), either through this library's runner (``python -m
orbax_maxtext_layout.maxtext maxtext.trainers.pre_train.train ...``) or stock (``python -m
maxtext.trainers.pre_train.train ...``). The Tunix runs are the frozen steps of MaxText's own
model: ``sft_run/checkpoints/2`` (MaxText's SFT trainer) and ``rl_run/checkpoints/actor/2``
(an RL actor), both the state after 2 updates.

What proves what:

- *start step*: MaxText's log (``restoring from this run's directory step 1``: Tunix directory
  2 listed as MaxText step 1; ``completed step: 2`` first; the first save is MaxText step 2);
- *bit-identity of the restored state*: the probe (maxtext_loop_support) writes the state
  MaxText's loop starts from, after its restore and overlay; it is compared leaf by leaf
  (bytes, dtype, typed-key impl) with the Tunix source read by stock Orbax. The runs
  initialize with ``init_weights_seed=1`` (the fixtures: 0), so that initialized values (which
  a restore keeps for anything it does not restore) cannot pass for restored ones. Independently,
  stock MaxText resumed from the migrated legacy step, and from a step converted by the CLI,
  starts from the same state and writes bit-identical saves (CPU training is deterministic);
- *saves*: the directories and their ``items/step`` read by stock Orbax, and MaxText's
  ``Saved a checkpoint`` and ``skipping save`` lines.

The runs are shared by module-scoped fixtures, two processes at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import maxtext_loop_support as L
import pytest

import orbax_maxtext_layout as oml

KINDS = ("sft", "rl")
# A Tunix directory N holds the state after N updates; MaxText numbers that state N - 1.
LEGACY = L.UPDATES - 1


def tunix_run(base: Path, kind: str) -> Path:
    """``<base>/run/checkpoints/2``: the Tunix step, where MaxText's manager reads ``<dir>/<step>``.

    For RL, Tunix writes the actor's steps under ``<rl run>/checkpoints/actor/<N>``. MaxText's
    ``checkpoint_dir`` is always ``<base_output_directory>/<run_name>/checkpoints/``, so a
    MaxText user resuming an RL run points that directory at the run's ``actor/`` directory
    (copies or symlinks ``actor/`` there); here the actor step goes directly to
    ``checkpoints/2``.
    """
    return L.copy_tree(L.TUNIX_STEPS[kind], base / "run" / "checkpoints" / str(L.UPDATES))


def source(kind: str) -> dict[str, L.Leaf]:
    """What MaxText must start from: the Tunix step as MaxText items, read with stock Orbax."""
    return L.expected_items(L.TUNIX_STEPS[kind], kind)


def assert_ok(run: L.Run, *, runner: bool) -> None:
    assert run.returncode == 0, run.why()
    assert (L.RUNNER_BANNER in run.log) is runner, run.why()
    meta = run.probe_meta()
    want = L.LIBRARY_CHECKPOINTER if runner else L.STOCK_CHECKPOINTER
    assert meta["checkpoint_manager"] == want
    if not runner:  # stock means stock: the library is not even imported
        assert meta["library_imported"] is False


def items(checkpoints: Path, step: int) -> dict[str, L.Leaf]:
    return L.read_item(checkpoints / str(step) / "items")


def assert_counts(tree: dict[str, L.Leaf], n: int) -> None:
    """``step``, Adam's count and the schedule's count are all ``n``."""
    assert [tree[p].value() for p in ("step", "opt_state/0/count", "opt_state/2/count")] == [n] * 3


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("maxtext_loop")


@pytest.fixture(scope="module")
def site(work) -> Path:
    return L.probe_site_dir(work)


@pytest.fixture(scope="module")
def target(work) -> Path:
    """A step of MaxText's own pre-training run of the same model (for ``--target-from``)."""
    return L.copy_tree(L.PRETRAIN_STEP, work / "pretrain_target" / "1")


@pytest.fixture(scope="module")
def resumed(work, site) -> dict[str, L.Run]:
    """Test 1's runs, for each Tunix run (``sft``, ``rl``):

    - ``<kind>_runner``: the runner resumes the Tunix run with ``steps=4`` (2 more updates);
    - then, on copies of what it left: ``<kind>_stock_after``, stock MaxText on the whole run
      with ``steps=5`` (one more update), and ``<kind>_stock_from_legacy``, stock MaxText on the
      migrated legacy directory 1 alone with ``steps=4``, as the runner (MaxText's learning-rate
      schedule depends on ``steps``, so only equal ``steps`` give comparable updates).
    """
    first = []
    for kind in KINDS:
        base = work / f"resume_{kind}"
        tunix_run(base, kind)
        first.append(L.Spec(f"{kind}_runner", base, steps=4, runner=True))
    runs = L.run_all(first, site)
    second = []
    for kind in KINDS:
        done = runs[f"{kind}_runner"]
        if done.returncode != 0 or not (done.checkpoints / str(LEGACY)).is_dir():
            continue  # its own test reports why
        after = work / f"after_{kind}"
        L.copy_tree(done.checkpoints, after / "run" / "checkpoints")
        second.append(L.Spec(f"{kind}_stock_after", after, steps=5, runner=False))
        legacy = work / f"legacy_{kind}"
        L.copy_tree(done.checkpoints / str(LEGACY), legacy / "run" / "checkpoints" / str(LEGACY))
        second.append(L.Spec(f"{kind}_stock_from_legacy", legacy, steps=4, runner=False))
    runs.update(L.run_all(second, site))
    return runs


def _runner(resumed, kind: str) -> L.Run:
    run = resumed[f"{kind}_runner"]
    assert_ok(run, runner=True)
    return run


# ------------------------------------------------------- 1. resume through the runner


@pytest.mark.parametrize("kind", KINDS)
def test_runner_resumes_at_the_tunix_update_count(kind, resumed):
    run = _runner(resumed, kind)
    # MaxText's own log: it restores its step 1, which is Tunix's directory 2 ...
    assert run.restored_from == [LEGACY]
    # ... holding the state after 2 updates, so the loop starts at step 2 and saves there first.
    assert run.probe()["step"].value() == L.UPDATES
    assert run.completed == [2, 3]
    assert run.saved == [2, 3]


@pytest.mark.parametrize("kind", KINDS)
def test_runner_restores_the_tunix_state_bit_identically(kind, resumed):
    """Weights, RNG counts and unsafe_rbg keys, Adam moments and counts, schedule count, step."""
    got = _runner(resumed, kind).probe()
    want = source(kind)
    assert L.diff(got, want, step_by_value=True) == []
    assert L.groups(got) == {
        "params/params": 12,
        "nnx_aux/model": 12,
        "opt_state/0": 25,
        "opt_state/2": 1,
        "step": 1,
    }
    keys = [x for x in got.values() if x.dtype == "key"]
    assert len(keys) == 6 and {x.key_impl for x in keys} == {"unsafe_rbg"}


def test_restored_rng_keys_are_not_initialized_ones(resumed, params_only):
    """The resumed runs' keys (bit-identical to Tunix's, above) are not what MaxText's init
    gives in these runs (``init_weights_seed`` 1, the fixtures 0): a params-only start keeps
    the init RNG state, and its 6 keys all differ. The RNG *counts* of these Tunix runs equal
    MaxText's init counts (training never draws from these streams), so the counts' identity
    cannot tell a restore from an init; they are restored with the keys, in ``nnx_aux``."""
    init = params_only["stock"]
    assert_ok(init, runner=False)
    init_rng = {p: x for p, x in init.probe().items() if p.startswith("nnx_aux/")}
    for kind in KINDS:
        restored = {p: x for p, x in _runner(resumed, kind).probe().items() if p in init_rng}
        differ = {p for p in init_rng if restored[p] != init_rng[p]}
        assert differ == {p for p in init_rng if p.endswith("/key")}


@pytest.mark.parametrize("kind", KINDS)
def test_runner_trains_two_more_steps_and_every_save_is_on_disk(kind, resumed):
    run = _runner(resumed, kind)
    assert L.step_dirs(run.checkpoints) == [LEGACY, 2, 3]
    assert L.leftovers(run.checkpoints) == []
    # No save was lost; the only skip is MaxText's end-of-run re-offer of the last step.
    assert run.lost_saves == []
    assert set(run.skipped) <= {3}
    for directory in (2, 3):
        step = run.checkpoints / str(directory)
        assert sorted(p.name for p in step.iterdir() if p.is_dir()) == ["items"]
        assert oml.detect_layout(step) is oml.Layout.MAXTEXT
        assert_counts(items(run.checkpoints, directory), directory + 1)
    # The first save after the resume is the state after one more update: every weight and
    # every moment moved away from the restored state.
    first, restored = items(run.checkpoints, 2), run.probe()
    moved = [p for p in first if p.startswith(("params/", "opt_state/0/mu/", "opt_state/0/nu/"))]
    assert len(moved) == 36
    assert [p for p in moved if first[p] == restored[p]] == []


@pytest.mark.parametrize("kind", KINDS)
def test_runner_migrates_the_legacy_step(kind, resumed, target):
    run = _runner(resumed, kind)
    legacy = run.checkpoints / str(LEGACY)
    assert (legacy / "items").is_dir()
    assert oml.detect_layout(legacy) is oml.Layout.MAXTEXT
    assert "items" in L.step_metadata(legacy)["item_handlers"]
    # MaxText's own layout: the stored specs (tree, shapes, dtypes, key impls) of MaxText's
    # pre-training step of the same model.
    assert oml.read_specs(legacy / "items") == oml.read_specs(target / "items")
    migrated = items(run.checkpoints, LEGACY)
    assert migrated["step"].dtype == "int32"
    assert L.diff(migrated, source(kind), step_by_value=True) == []


@pytest.mark.parametrize("kind", KINDS)
def test_stock_maxtext_resumes_the_run_afterwards(kind, resumed):
    run = _runner(resumed, kind)
    after = resumed[f"{kind}_stock_after"]
    assert_ok(after, runner=False)
    assert after.restored_from == [3]
    assert after.completed == [4]
    assert after.saved == [4]
    assert after.lost_saves == []
    assert set(after.skipped) <= {4}  # only the end-of-run re-offer of the step just saved
    assert L.step_dirs(after.checkpoints) == [LEGACY, 2, 3, 4]
    assert_counts(items(after.checkpoints, 4), 5)
    assert L.diff(after.probe(), items(run.checkpoints, 3), step_by_value=True) == []


@pytest.mark.parametrize("kind", KINDS)
def test_stock_maxtext_resumes_the_migrated_legacy_step(kind, resumed):
    """Stock MaxText on the migrated step alone starts from exactly the state the runner
    restored from Tunix, and its saves are bit-identical to the runner's."""
    run = _runner(resumed, kind)
    legacy = resumed[f"{kind}_stock_from_legacy"]
    assert_ok(legacy, runner=False)
    assert legacy.restored_from == [LEGACY]
    assert legacy.saved == [2, 3]
    assert legacy.lost_saves == []
    assert set(legacy.skipped) <= {3}
    assert L.diff(legacy.probe(), run.probe()) == []
    for directory in (2, 3):
        assert L.diff(items(legacy.checkpoints, directory), items(run.checkpoints, directory)) == []


# ------------------------------------------------------- 2. convert, then stock MaxText


@pytest.fixture(scope="module")
def converted(work, site, target) -> dict[str, object]:
    """The SFT run converted by the CLI, by default (Tunix 2 -> 1) and with
    ``--keep-step-numbers`` (2 stays 2); then stock MaxText resumes each with ``steps=4``."""
    out: dict[str, object] = {}
    specs = []
    for name, flags in (("renumbered", ()), ("kept", ("--keep-step-numbers",))):
        base = work / f"converted_{name}"
        checkpoints = tunix_run(base, "sft").parent
        report = L.cli("convert", str(checkpoints), "--target-from", str(target), "--json", *flags)
        out[f"{name}_report"] = json.loads(report.stdout)
        out[f"{name}_dirs"] = L.step_dirs(checkpoints)
        specs.append(L.Spec(name, base, steps=4, runner=False))
    out.update(L.run_all(specs, site))
    return out


def _converted_dir(report: list[dict]) -> tuple[str, str, int]:
    """(status, directory name, step) of the one step the CLI's --json report lists."""
    [entry] = report
    return entry["status"], Path(entry["step_dir"]).name, entry["step"]


def test_convert_renumbers_and_stock_maxtext_resumes_with_no_skipped_save(converted):
    assert _converted_dir(converted["renumbered_report"]) == ("converted", "1", L.UPDATES)
    assert converted["renumbered_dirs"] == [LEGACY]
    run = converted["renumbered"]
    assert_ok(run, runner=False)
    assert run.restored_from == [LEGACY]
    assert run.probe()["step"].value() == L.UPDATES
    assert run.completed == [2, 3]
    assert run.saved == [2, 3]
    assert run.lost_saves == []
    assert set(run.skipped) <= {3}  # only the end-of-run re-offer of the last, saved step
    assert L.step_dirs(run.checkpoints) == [LEGACY, 2, 3]
    assert L.leftovers(run.checkpoints) == []
    for directory in (2, 3):
        assert_counts(items(run.checkpoints, directory), directory + 1)
    assert L.diff(run.probe(), source("sft"), step_by_value=True) == []


def test_converted_resume_trains_exactly_like_the_runner(converted, resumed):
    run, ours = converted["renumbered"], _runner(resumed, "sft")
    assert_ok(run, runner=False)
    for directory in (2, 3):
        assert L.diff(items(run.checkpoints, directory), items(ours.checkpoints, directory)) == []


def test_convert_keeping_tunix_numbers_loses_the_first_save(converted):
    """Why the CLI renumbers by default: left at 2, the converted step (the state after 2
    updates) makes MaxText start at step 2 and skip that step's save, so the state after
    update 3 is never written."""
    assert _converted_dir(converted["kept_report"]) == ("converted", "2", L.UPDATES)
    assert converted["kept_dirs"] == [L.UPDATES]
    run = converted["kept"]
    assert_ok(run, runner=False)
    assert run.restored_from == [L.UPDATES]
    assert "Checkpoint for step 2 already exists, skipping save" in run.log
    assert run.lost_saves == [2]
    assert run.saved == [3]


# ------------------------------------------- 3. load_parameters_path=<tunix step>/model_params


@pytest.fixture(scope="module")
def params_only(work, site, target) -> dict[str, L.Run]:
    """``steps=1`` runs with no checkpoints in the run directory, loading weights only:

    - ``<kind>``: the runner, ``load_parameters_path=<tunix step>/model_params``;
    - ``stock``: stock MaxText, ``load_parameters_path=<the SFT step converted by the CLI>/items``.
    """
    specs = []
    for kind in KINDS:
        step = L.copy_tree(L.TUNIX_STEPS[kind], work / f"params_{kind}_source" / "2")
        extra = (f"load_parameters_path={step / 'model_params'}",)
        specs.append(L.Spec(kind, work / f"params_{kind}", steps=1, runner=True, extra=extra))
    checkpoints = tunix_run(work / "params_converted", "sft").parent
    L.cli("convert", str(checkpoints), "--target-from", str(target))
    extra = (f"load_parameters_path={checkpoints / str(LEGACY) / 'items'}",)
    specs.append(L.Spec("stock", work / "params_stock", steps=1, runner=False, extra=extra))
    return L.run_all(specs, site)


@pytest.mark.parametrize("kind", KINDS)
def test_runner_loads_tunix_model_params_bit_identically(kind, params_only, work):
    run = params_only[kind]
    assert_ok(run, runner=True)
    assert run.restored_from == []  # nothing in the run directory: a params-only start
    got = run.probe()
    assert L.diff(L.weights(got), L.weights(source(kind))) == []
    # A params-only load: the optimizer starts fresh, at step 0.
    assert_counts(got, 0)
    moments = [x for p, x in got.items() if p.startswith(("opt_state/0/mu/", "opt_state/0/nu/"))]
    assert len(moments) == 24 and not any(x.array.any() for x in moments)
    assert run.saved == [0] and run.lost_saves == []
    assert_counts(items(run.checkpoints, 0), 1)
    # Reading is all it does: the Tunix step is left as it was.
    step = work / f"params_{kind}_source" / "2"
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == [
        "model_params",
        "optimizer_state",
    ]


def _not_weights(tree: dict[str, L.Leaf]) -> dict[str, L.Leaf]:
    return {p: x for p, x in tree.items() if not p.startswith("params/")}


@pytest.mark.parametrize("kind", KINDS)
def test_runner_params_load_matches_stock_load_of_the_converted_step(kind, params_only):
    """Everything but the weights is MaxText's fresh init, the same as in a stock params-only
    load; for SFT (the step stock MaxText loads, converted) the runs are identical throughout."""
    run, stock = params_only[kind], params_only["stock"]
    assert_ok(run, runner=True)
    assert_ok(stock, runner=False)
    ours, theirs = run.probe(), stock.probe()
    if kind == "sft":
        assert L.diff(ours, theirs) == []
        assert L.diff(items(run.checkpoints, 0), items(stock.checkpoints, 0)) == []
    else:
        assert L.diff(_not_weights(ours), _not_weights(theirs)) == []
        assert L.diff(L.weights(ours), L.weights(theirs)) != []  # other weights, from RL


# ------------------------------------------------------- 4. stock MaxText on a Tunix run


@pytest.fixture(scope="module")
def stock_on_tunix(work, site) -> dict[str, L.Run]:
    """Stock MaxText, no library: resuming the unconverted SFT run, and loading its
    ``model_params`` as parameters."""
    tunix_run(work / "stock_resume", "sft")
    step = L.copy_tree(L.SFT_STEP, work / "stock_params_source" / "2")
    return L.run_all(
        [
            L.Spec("resume", work / "stock_resume", steps=4, runner=False),
            L.Spec(
                "params",
                work / "stock_params",
                steps=1,
                runner=False,
                extra=(f"load_parameters_path={step / 'model_params'}",),
            ),
        ],
        site,
    )


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_stock_maxtext_cannot_resume_a_tunix_run(stock_on_tunix):
    run = stock_on_tunix["resume"]
    assert run.returncode != 0, run.why()
    assert L.RUNNER_BANNER not in run.log
    # Stock MaxText lists Tunix directory 2 as its step 2 and asks it for MaxText's `items`.
    assert run.restored_from == [L.UPDATES]
    assert (
        "KeyError: \" Requested checkpointables: dict_keys(['items']) for loading were not "
        "found in the checkpoint. Available checkpointables: ['model_params', "
        "'optimizer_state']\"" in run.log
    ), run.why()
    assert run.saved == []
    assert L.step_dirs(run.checkpoints) == [L.UPDATES]
    assert _files(run.checkpoints / str(L.UPDATES)) == _files(L.SFT_STEP)


def test_stock_maxtext_cannot_load_tunix_model_params(stock_on_tunix, work):
    run = stock_on_tunix["params"]
    assert run.returncode != 0, run.why()
    assert L.RUNNER_BANNER not in run.log
    path = work / "stock_params_source" / "2" / "model_params"
    assert (
        "orbax.checkpoint.experimental.v1._src.layout.checkpoint_layout.InvalidLayoutError: "
        f"Could not recognize the checkpoint at {path} as a valid Orbax checkpoint." in run.log
    ), run.why()
    assert run.saved == []
