"""Interop (issue 23): MaxText 0.2.5's own code reads the scan form this library records.

Every step the library writes records ``custom_metadata["scan_layers"]``, as MaxText's own
``save_checkpoint`` does, and MaxText's ``verify_and_sync_scan_layers`` (called by
``to_huggingface`` and by ``from_pretrained``, the SFT entry) takes the model's scan form from
it when the command line has no ``scan_layers`` key, and refuses a contradicting one.
``convert --unroll`` of MaxText's scanned SFT state against MaxText's own *unscanned* model
keeps layer 0's RNG state in ``layers_0`` (the unscanned model's one shared stream).

The steps: the frozen fixtures of tests/fixtures/maxtext025 (their README), copied first.

- merged: ``orbax-maxtext-layout merge-lora lora_run/checkpoints/2 --base
  pretrain_run/checkpoints/1 --alpha 8`` (the trained LoRA step of ``train_sft`` and the base it
  started from, as test_lora.py merges them), scanned and ``--unroll``;
- converted: ``orbax-maxtext-layout convert`` of ``sft_run/checkpoints/2`` (``train_sft``'s
  Tunix state), scanned against ``pretrain_run/checkpoints/1`` and ``--unroll`` against
  ``pretrain_unscanned_run/checkpoints/0``.

Every MaxText process is stock (this library is not on its path), on CPU, offline:

- A. ``to_huggingface`` (hf_export_support) of each unrolled ``<step>/items`` without a
  ``scan_layers`` key writes the same tensors (names, shapes, dtypes, bytes) and ``config.json``
  as of the scanned one, also without the key; its log shows MaxText took ``scan_layers=False``
  from the metadata. Anchors make the comparison non-vacuous: a layer's ``down_proj`` is that
  layer's slice of the scanned step's ``wo`` (the merged one differs from the base's);
- B. with an explicit ``scan_layers=true`` on the unrolled merge, ``to_huggingface`` stops with
  MaxText's own "Configuration mismatch" and writes no weights;
- C. ``train_sft`` (hf_export_support) from ``load_parameters_path=<unrolled merge>/0/items``,
  no ``scan_layers`` key, trains 2 steps of the unscanned model, starting from the merged weights
  (its step 1 is within one Adam step of them; it initializes with another seed);
- D. stock ``python -m maxtext.trainers.pre_train.train ... scan_layers=false`` resumes the
  unrolled converted run (its checkpoint directory, as test_maxtext_loop.py resumes converted
  runs) at step 2, from exactly the unrolled Tunix state (the probe of maxtext_loop_support),
  and trains and saves steps 2 and 3.

All children run from one module fixture, two at a time.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import numpy as np
import pytest

N_LAYERS = 3
ALPHA = L.generator().LORA_ALPHA
LORA_STEP = L.FIXTURE / "lora_run" / "checkpoints" / "2"
SCANNED_TARGET = L.PRETRAIN_STEP  # pretrain_run/checkpoints/1, also the LoRA run's base
UNSCANNED_TARGET = L.FIXTURE / "pretrain_unscanned_run" / "checkpoints" / "0"
FORMS = ("scanned", "unrolled")
SOURCES = ("merged", "converted")
N_TENSORS = 3 + 9 * N_LAYERS  # embed, norm, lm_head; 9 per layer
MISMATCH = (
    "Configuration mismatch: Your run specifies scan_layers=True, "
    "but the checkpoint was saved with scan_layers=False."
)
WO = "params/params/decoder/layers/mlp/wo/kernel"


class UnscannedSpec(L.Spec):
    """A MaxText run of the same tiny model with ``scan_layers=false``."""

    def argv(self) -> list[str]:
        return ["scan_layers=false" if a == "scan_layers=true" else a for a in super().argv()]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scan_layers")


@pytest.fixture(scope="module")
def tokenizer(work) -> Path:
    return S.write_tokenizer(work / "tokenizer")


@pytest.fixture(scope="module")
def merged(work) -> dict[str, Path]:
    """form -> ``<out>/0/items`` of ``merge-lora`` (the CLI), scanned and ``--unroll``."""
    step = L.copy_tree(LORA_STEP, work / "lora" / "checkpoints" / "2")
    base = L.copy_tree(SCANNED_TARGET, work / "lora_base" / "1")
    out = {}
    for form, flags in (("scanned", ()), ("unrolled", ("--unroll",))):
        dest = work / f"merged_{form}"
        args = ("merge-lora", str(step), "--base", str(base), "--alpha", f"{ALPHA:g}")
        L.cli(*args, "--out", str(dest), *flags)
        out[form] = dest / "0" / "items"
    return out


@pytest.fixture(scope="module")
def converted(work) -> dict[str, object]:
    """form -> ``<run>/checkpoints/1/items`` of ``convert`` (the CLI) of the SFT state:
    scanned against the scanned pre-training step, ``--unroll`` against the unscanned one;
    ``report`` is the ``--unroll`` run's ``--json`` report."""
    out: dict[str, object] = {}
    for form, target, flags in (
        ("scanned", SCANNED_TARGET, ()),
        ("unrolled", UNSCANNED_TARGET, ("--unroll",)),
    ):
        checkpoints = work / f"converted_{form}" / "run" / "checkpoints"
        L.copy_tree(L.SFT_STEP, checkpoints / str(L.UPDATES))
        target = L.copy_tree(target, work / f"target_{form}" / target.name)
        proc = L.cli("convert", str(checkpoints), "--target-from", str(target), "--json", *flags)
        assert L.step_dirs(checkpoints) == [L.UPDATES - 1]  # renumbered: Tunix 2 -> MaxText 1
        out[form] = checkpoints / str(L.UPDATES - 1) / "items"
        if flags:
            out["report"] = json.loads(proc.stdout)
    return out


@pytest.fixture(scope="module")
def children(work, tokenizer, merged, converted) -> dict[str, object]:
    """Every MaxText process, two at a time:

    - ``<source>_<form>``: ``to_huggingface`` of each step's items, no ``scan_layers`` key (A);
    - ``explicit_true``: the same on the unrolled merge with ``scan_layers=true`` (B);
    - ``train_sft``: ``train_sft`` from the unrolled merge, no ``scan_layers`` key (C);
    - ``resume``: stock pre-training with ``scan_layers=false`` resuming a copy of the unrolled
      converted run, ``steps=4`` (D).
    """
    steps = {"merged": merged, "converted": converted}
    jobs = [
        S.export_job(
            f"{source}_{form}", steps[source][form], work / "hf" / f"{source}_{form}", tokenizer
        )
        for source in SOURCES
        for form in FORMS
    ]
    jobs.append(
        S.export_job(
            "explicit_true",
            merged["unrolled"],
            work / "hf" / "explicit_true",
            tokenizer,
            scan_layers=True,
        )
    )
    jobs.append(S.train_sft_job("train_sft", work / "train_sft", merged["unrolled"]))
    resume = work / "resume"
    L.copy_tree(converted["unrolled"].parents[1], resume / "run" / "checkpoints")
    spec = UnscannedSpec("resume", resume, steps=4, runner=False)
    site = L.probe_site_dir(work)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"resume": pool.submit(L.run, spec, site)}
        futures.update({j.name: pool.submit(S.run, j) for j in jobs})
        return {name: f.result() for name, f in futures.items()}


def _export(children, name: str) -> S.Proc:
    proc = children[name]
    assert proc.returncode == 0, proc.why()
    return proc


# ----------------------------------------------------------------------------- the steps


@pytest.mark.parametrize("source", SOURCES)
def test_steps_record_the_scan_form_written(source, merged, converted):
    """What MaxText reads: ``custom_metadata.scan_layers`` of the step holding ``items``."""
    steps = {"merged": merged, "converted": converted}[source]
    for form in FORMS:
        meta = L.step_metadata(steps[form].parent)
        assert meta["custom_metadata"]["scan_layers"] is (form == "scanned")
        layers = {p.split("/")[3] for p in L.weights(L.read_item(steps[form])) if "layers" in p}
        assert layers == ({"layers"} if form == "scanned" else {"layers_0", "layers_1", "layers_2"})


def test_unroll_keeps_layer_0_rng_for_the_shared_stream(converted):
    """Item 2: the SFT state's scanned RNG state, against MaxText's unscanned model: layer 0's
    is written to ``layers_0``, layers 1 and 2's are dropped with the shared-stream reason, and
    ``decoder/rngs`` (not held by the unscanned model) with its own reason."""
    [entry] = converted["report"]
    assert entry["status"] == "converted"
    drops = {d["path"]: d["reason"] for d in entry["dropped"]}
    shared = "the unscanned model shares one RNG stream across its layers"
    streams = [f"{s}/{leaf}" for s in ("aqt", "dropout", "params") for leaf in ("count", "key")]
    want = {
        f"decoder/layers/self_attention/rngs/{s}/value/[scan step {i}: layers_{i}]": shared
        for s in streams
        for i in (1, 2)
    }
    want.update(
        {f"decoder/rngs/{s}/value": "RNG state the unscanned target does not hold" for s in streams}
    )
    assert drops == want
    aux = {p for p in L.read_item(converted["unrolled"]) if p.startswith("nnx_aux/")}
    assert aux == {f"nnx_aux/model/decoder/layers_0/self_attention/rngs/{s}" for s in streams}


# ----------------------------------------------------------------------------- A. to_huggingface


@pytest.mark.parametrize("source", SOURCES)
def test_to_huggingface_exports_the_unrolled_step_as_the_scanned_one(
    source, children, merged, converted, work
):
    scanned, unrolled = (
        _export(children, f"{source}_scanned"),
        _export(children, f"{source}_unrolled"),
    )
    # MaxText took the scan form from the metadata: only the unrolled step differs from the
    # default (scan_layers: true in base.yml), and there is no key on either command line.
    assert not any(a.startswith("scan_layers=") for a in scanned.argv + unrolled.argv)
    assert S.SYNCED_FROM_METADATA.format(False) in unrolled.log, unrolled.why()
    assert "loaded from checkpoint metadata" not in scanned.log
    out = {form: work / "hf" / f"{source}_{form}" for form in FORMS}
    got, want = S.read_hf(out["unrolled"]), S.read_hf(out["scanned"])
    assert len(want) == N_TENSORS
    assert S.hf_diff(got, want) == []
    assert S.hf_config(out["unrolled"]) == S.hf_config(out["scanned"])
    assert S.hf_config(out["scanned"])["num_hidden_layers"] == N_LAYERS
    # Anchors: the export is of this step (down_proj_i = wo[:, i, :].T, MaxText's reshape hook).
    step = {"merged": merged, "converted": converted}[source]["scanned"]
    wo = L.read_item(step)[WO].array
    base_wo = L.read_item(SCANNED_TARGET / "items")[WO].array
    for i in range(N_LAYERS):
        down = got[f"model.layers.{i}.mlp.down_proj.weight"]
        assert np.array_equal(down, wo[:, i, :].T)
        # The merge is in it (the base's kernel differs); the convert is the SFT state, not
        # the target's weights.
        assert not np.array_equal(down, base_wo[:, i, :].T)


# ----------------------------------------------------------------------------- B. the refusal


def test_to_huggingface_refuses_explicit_scan_layers_true_on_an_unrolled_step(children, work):
    proc = children["explicit_true"]
    assert "scan_layers=true" in proc.argv
    assert proc.returncode != 0, proc.why()
    assert MISMATCH in proc.log, proc.why()
    assert not list((work / "hf" / "explicit_true").glob("*.safetensors"))


# ----------------------------------------------------------------------------- C. train_sft


def tunix_weights(step: Path) -> dict[str, L.Leaf]:
    """A Tunix step's weights under MaxText's names (``params/params/...``, no ``value``)."""
    params = L.read_item(step / "model_params")
    return {
        "params/params/" + p.removesuffix("/value"): x
        for p, x in params.items()
        if "/rngs/" not in p
    }


def test_train_sft_starts_from_the_unrolled_merge_without_a_scan_layers_key(children, merged):
    proc = children["train_sft"]
    assert proc.returncode == 0, proc.why()
    assert not any("scan_layers=" in a for a in proc.argv)
    assert S.SYNCED_FROM_METADATA.format(False) in proc.log, proc.why()
    checkpoints = proc.cwd / "run" / "checkpoints"
    assert L.step_dirs(checkpoints) == [1, 2]  # Tunix's CheckpointManager, after updates 1, 2
    opt = L.read_item(checkpoints / "2" / "optimizer_state")
    assert opt["step/value"].value() == 2
    start = L.weights(L.read_item(merged["unrolled"]))
    saved = {step: tunix_weights(checkpoints / str(step)) for step in (1, 2)}
    # The unscanned model: the merged step's 30 weights, by name and shape.
    for got in saved.values():
        assert {p: x.shape for p, x in got.items()} == {p: x.shape for p, x in start.items()}
    # Started from the merged weights (not an init with its seed): one update (lr 2e-5) moved
    # every one of them, by little.
    moved = {p: float(np.abs(saved[1][p].array - x.array).max()) for p, x in start.items()}
    assert all(0 < d < 1e-4 for d in moved.values()), moved


# ----------------------------------------------------------------------------- D. resume


def unrolled_items(tree: dict[str, L.Leaf]) -> dict[str, L.Leaf]:
    """MaxText items of the scanned model, as the unscanned model holds them: each scanned
    weight and Adam moment sliced on the layer axis (1, ``param_scan_axis``) into
    ``layers_<i>``; the layers' RNG state (layer axis 0) kept for layer 0 only, in
    ``layers_0``; ``decoder/rngs`` (the unscanned model has none) dropped."""

    def take(x: L.Leaf, i: int, axis: int) -> L.Leaf:
        a = np.array(np.take(x.array, i, axis=axis))  # a contiguous copy, 0-d kept 0-d
        return L.Leaf(x.dtype, x.key_impl, a.shape, a.tobytes(), a)

    out = {}
    for p, x in tree.items():
        if p.startswith("nnx_aux/model/decoder/rngs/"):
            continue
        if "/decoder/layers/" not in p:
            out[p] = x
        elif p.startswith("nnx_aux/"):
            out[p.replace("/layers/", "/layers_0/")] = take(x, 0, 0)
        else:
            for i in range(N_LAYERS):
                out[p.replace("/layers/", f"/layers_{i}/")] = take(x, i, 1)
    return out


def test_stock_maxtext_resumes_the_unrolled_convert_with_scan_layers_false(children, converted):
    run = children["resume"]
    assert run.returncode == 0, run.why()
    meta = run.probe_meta()
    assert meta["checkpoint_manager"] == L.STOCK_CHECKPOINTER
    assert meta["library_imported"] is False
    assert "scan_layers=false" in run.argv
    # Directory 1 holds the state after 2 updates: MaxText restores it and starts at step 2.
    assert run.restored_from == [L.UPDATES - 1]
    got = run.probe()
    assert got["step"].value() == L.UPDATES
    want = unrolled_items(L.expected_items(L.SFT_STEP, "sft"))
    assert L.groups(want) == {
        "params/params": 30,
        "nnx_aux/model": 6,
        "opt_state/0": 61,
        "opt_state/2": 1,
        "step": 1,
    }
    # Weights, layer 0's RNG counts and unsafe_rbg keys, Adam moments and counts, schedule
    # count: the Tunix state, bit for bit, as the unscanned model holds it.
    assert L.diff(got, want, step_by_value=True) == []
    assert L.diff(L.read_item(converted["unrolled"]), want, step_by_value=True) == []
    # It trains: steps 2 and 3 completed and saved, nothing lost, in the unscanned form.
    assert run.completed == [2, 3]
    assert run.saved == [2, 3]
    assert run.lost_saves == []
    assert L.step_dirs(run.checkpoints) == [1, 2, 3]
    assert L.leftovers(run.checkpoints) == []
    for directory in (2, 3):
        saved = L.read_item(run.checkpoints / str(directory) / "items")
        assert set(saved) == set(want)
        assert [saved[p].value() for p in ("step", "opt_state/0/count", "opt_state/2/count")] == [
            directory + 1
        ] * 3
    first = L.read_item(run.checkpoints / "2" / "items")
    weights = [p for p in want if p.startswith("params/")]
    assert [p for p in weights if first[p] == got[p]] == []
