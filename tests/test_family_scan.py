"""Scan changes of the real gemma3 and mixtral fixtures without MaxText's config.

With a MaxText checkpoint of the other form as the target (``--target-from``), the block
structure of gemma3 is read off the Tunix step itself (`layermap.from_forms`): step ``r`` of
``layers/layers_<k>`` becomes MaxText's ``layers_<r*6+k>``. Oracles: the stored values of the
Tunix step, sliced on axis 1 (MaxText's ``param_scan_axis`` for these runs), and the
pre-training steps' trees (MaxText's own layout of each form). MaxText itself judges the same
conversions in tests/interop/test_families*.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import FIXTURES, copy_fixture, raw, restore_flat, tree_digest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.plan import rescan

M = "maxtext025"
P = ("params", "params")
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


def _target(run: str) -> oml.Target:
    return oml.Target.from_checkpoint(FIXTURES / M / run / "checkpoints" / "0")


def _weights(step) -> dict:
    """``{model path: array}`` of a Tunix step's model_params (``value`` levels dropped)."""
    flat = restore_flat(step / "model_params")
    return {p[:-1] if p[-1] == "value" else p: v for p, v in flat.items()}


def _unrolled_name(path: tuple, block: int, r: int) -> tuple:
    """MaxText's unscanned path of step ``r`` of a scanned weight's layer."""
    i = path.index("layers")
    if block:  # decoder/layers/layers_<k>/... -> decoder/layers_<r*block+k>/...
        k = int(path[i + 1].removeprefix("layers_"))
        return (*path[:i], f"layers_{r * block + k}", *path[i + 2 :])
    return (*path[:i], f"layers_{r}", *path[i + 1 :])


@pytest.mark.parametrize(
    ("run", "unscanned", "block"),
    [
        ("gemma3_sft_run", "gemma3_pretrain_unscanned_run", 6),
        ("mixtral_sft_run", "mixtral_pretrain_unscanned_run", 0),
    ],
)
def test_unroll_against_maxtext_s_unscanned_checkpoint(tmp_path, run, unscanned, block):
    weights = _target(unscanned.replace("_unscanned", "")).params  # the scanned model's
    step = copy_fixture(f"{M}/{run}/checkpoints/2", tmp_path)
    target = _target(unscanned)
    report = oml.convert_step(step, target, rescan="unroll")
    assert "unroll" in report.rules
    # A dropped RNG slice is named by its scan step and the layer it is unscanned: gemma3's
    # step 1 of sub-layer 0 is layers_6 (it read "[layer 1]").
    steps = {d["path"].rsplit("/", 1)[1] for d in report.dropped if d["path"].endswith("]")}
    assert steps == {f"[scan step 1: layers_{block or 1}]"}, steps
    # MaxText's unscanned layout, every weight and Adam moment; only RNG state its model has.
    got = oml.read_specs(step / "items")
    want = oml.read_specs(FIXTURES / M / unscanned / "checkpoints" / "0" / "items")
    assert {p for p in got if p[0] != "nnx_aux"} == {p for p in want if p[0] != "nnx_aux"}
    assert {p for p in got if p[0] == "nnx_aux"} <= {p for p in want if p[0] == "nnx_aux"}
    assert all(got[p] == want[p] for p in got if p[:1] == ("params",))
    items = restore_flat(step / "items")
    checked = 0
    for p, w in _weights(step).items():
        if p not in weights:
            continue
        if "layers" not in p:
            assert np.array_equal(raw(items[P + p]), raw(w)), p
            continue
        for r in range(w.shape[1]):
            q = P + _unrolled_name(p, block, r)
            assert raw(items[q]).tobytes() == raw(w)[:, r].tobytes(), q
            checked += 1
    assert checked == len(target.params) - (len(weights) - sum("layers" in p for p in weights))
    assert oml.verify_step(step).ok
    assert oml.converted_provenance(step)["scan"] == "unroll"


@pytest.mark.parametrize(
    ("run", "scanned", "block"),
    [
        ("gemma3_sft_unscanned_run", "gemma3_pretrain_run", 6),
        ("mixtral_sft_unscanned_run", "mixtral_pretrain_run", 0),
    ],
)
def test_stack_onto_maxtext_s_scanned_checkpoint(tmp_path, run, scanned, block):
    step = copy_fixture(f"{M}/{run}/checkpoints/2", tmp_path)
    unscanned = _target(run.replace("sft", "pretrain"))
    before = tree_digest(step)
    # No scanned form at hand: a block scan cannot be told from a plain one. Refused (a usage
    # error naming what to give), nothing written, unless the caller says it is plain.
    with pytest.raises(oml.UsageError, match=r"--maxtext-config.*--target-from.*--plain-scan"):
        oml.convert_step(step, unscanned, rescan="stack")
    assert tree_digest(step) == before
    guessed = oml.convert_step(step, unscanned, rescan="stack", plain_scan=True, dry_run=True)
    assert rescan.GUESSED_SCAN in guessed.notes  # on the caller's word: the report says so
    report = oml.convert_step(step, _target(scanned), rescan="stack")
    assert rescan.GUESSED_SCAN not in report.notes
    got = oml.read_specs(step / "items")
    want = oml.read_specs(FIXTURES / M / scanned / "checkpoints" / "0" / "items")
    assert got == want  # MaxText's scanned layout, RNG state included (fresh where unheld)
    items = restore_flat(step / "items")
    source = _weights(step)
    for p in [q for q in got if q[:2] == P and "layers" in q]:
        stacked = raw(items[p])
        for r in range(stacked.shape[1]):
            layer = source[_unrolled_name(p[2:], block, r)]
            assert stacked[:, r].tobytes() == raw(layer).tobytes(), (p, r)
    assert oml.verify_step(step).ok


def test_inspect_prints_each_step_s_layer_map(tmp_path, capsys):
    from orbax_maxtext_layout.cli import main as cli

    got = {}
    for run in ("gemma3_remainder_sft_run", "gemma3_sft_unscanned_run", "mixtral_sft_run"):
        step = copy_fixture(f"{M}/{run}/checkpoints/2", tmp_path)
        assert cli(["inspect", str(step.parent), "--json"]) == 0
        got[run] = json.loads(capsys.readouterr().out)[0]["scan"]
    assert got["gemma3_remainder_sft_run"] == {
        "scanned": True,
        "layers": [
            "decoder/layers: 1 scan steps, blocks of 6 sub-layers -> decoder/layers_<i>",
            "decoder/layers_remainder/layers_0: stored per layer -> decoder/layers_6",
            "decoder/layers_remainder/layers_1: stored per layer -> decoder/layers_7",
        ],
    }
    assert got["gemma3_sft_unscanned_run"] == {"scanned": False, "layers": []}
    assert got["mixtral_sft_run"]["layers"] == [
        "decoder/layers: 2 scan steps, one layer a step -> decoder/layers_<i>"
    ]
    assert cli(["inspect", str(tmp_path / M / "mixtral_sft_run" / "checkpoints")]) == 0
    assert "  layers: scanned\n    decoder/layers: 2 scan steps" in capsys.readouterr().out


def test_cli_stack_onto_an_unscanned_target_is_a_usage_error_without_plain_scan(tmp_path):
    # gpt-oss, gemma3, llama4: block scans whose unscanned names are a plain scan's. Stacking
    # without the model's scanned form wrote a plain stack (exit 0) that MaxText cannot read.
    from forked_cli import run_cli  # python -m orbax_maxtext_layout, forked from a warm one

    run = copy_fixture(f"{M}/gemma3_sft_unscanned_run", tmp_path)
    step = run / "checkpoints" / "2"
    target = FIXTURES / M / "gemma3_pretrain_unscanned_run" / "checkpoints" / "0"
    before = tree_digest(run)
    argv = ["convert", run / "checkpoints", "--stack", "--target-from", target]
    argv += ["--keep-step-numbers"]
    res = run_cli(*argv, cwd=os.getcwd())
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--plain-scan" in res.stderr and "--maxtext-config" in res.stderr
    assert "Traceback" not in res.stderr
    assert tree_digest(run) == before
    res = run_cli(*argv, "--plain-scan", cwd=os.getcwd())
    assert res.returncode == 0, res.stdout + res.stderr
    assert (step / "items").is_dir()
