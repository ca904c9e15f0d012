"""``convert STEP --unroll|--stack --out DIR`` of a MaxText-layout step (issue 41, item 3).

A MaxText user who trained scanned and wants the unscanned form for decoding (or the reverse)
converts the native step into a separate step: the source's ``items/`` are only read, and
the output is planned as identity moves over every leaf and transformed by the same
`rescan` engine as a Tunix step. Oracles, without MaxText: the source's stored values (stock
Orbax restores) sliced or stacked on each leaf's own axis (Params and their Adam moments on
``param_scan_axis`` 1, RNG state on 0), and MaxText's own step of the other form (its tree,
shapes and dtypes). MaxText itself reads the outputs in tests/interop/test_maxtext_rescan.py.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, RL_ACTOR_STEPS, copy_fixture, raw, restore_flat, tree_digest
from test_cli import cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout import cli as omtl_cli
from orbax_maxtext_layout.plan import rescan

M = "maxtext025"
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")

# family -> (scanned step, unscanned step, layers per scan step of a block: 0 for a plain scan)
FAMILIES = {
    "llama": ("pretrain_run/checkpoints/1", "pretrain_unscanned_run/checkpoints/0", 0),
    "gemma3": (
        "gemma3_pretrain_run/checkpoints/0",
        "gemma3_pretrain_unscanned_run/checkpoints/0",
        6,
    ),
    "mixtral": (
        "mixtral_pretrain_run/checkpoints/0",
        "mixtral_pretrain_unscanned_run/checkpoints/0",
        0,
    ),
}


def _unrolled(path: tuple, block: int, r: int) -> tuple:
    """MaxText's unscanned path of scan step ``r`` of a stacked leaf (any items path: params,
    nnx_aux or an optimizer moment): ``layers`` -> ``layers_<r>``; gemma3's block
    ``layers/layers_<k>`` -> ``layers_<r*block+k>``."""
    i = path.index("layers")
    if block:
        k = int(path[i + 1].removeprefix("layers_"))
        return (*path[:i], f"layers_{r * block + k}", *path[i + 2 :])
    return (*path[:i], f"layers_{r}", *path[i + 1 :])


def _axis(path: tuple) -> int:
    """The layer axis MaxText stacks a leaf on: RNG state (nnx_aux) 0, Params and the moments
    that mirror them ``param_scan_axis`` (1 in these runs)."""
    return 0 if path[0] == "nnx_aux" else 1


def _in_layers(path: tuple) -> bool:
    return "layers" in path


def _convert(*args: object) -> tuple[int, str]:
    """``convert ARGS`` in-process (the CLI's own parsing and exit codes)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = omtl_cli.main(["convert", *map(str, args)])
    return rc, buf.getvalue()


def _write_shapes_of_another_rank(item: Path) -> list[str]:
    """Leaves whose ``_METADATA`` ``write_shape`` has another rank than the stored array (a
    scalar RNG count's ``[]`` kept for its stack of shape ``[L]``: refused as forged by this
    library's own readers, `zarr.check_zarr_metadata`)."""
    tree = json.loads((item / "_METADATA").read_text())["tree_metadata"]
    shapes = {tuple(map(str, p)): s.shape for p, s in oml.read_specs(item).items()}
    return [
        k
        for k, v in tree.items()
        if (ws := v["value_metadata"].get("write_shape")) is not None
        and len(ws) != len(shapes[tuple(map(str, ast.literal_eval(k)))])
    ]


def _custom(step: Path) -> dict:
    return json.loads((step / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]


@pytest.mark.parametrize("scan", ["unroll", "stack"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_maxtext_step_changes_scan_form_into_out(tmp_path, family, scan):
    scanned, unscanned, block = FAMILIES[family]
    src_rel, other = (scanned, unscanned) if scan == "unroll" else (unscanned, scanned)
    step = copy_fixture(f"{M}/{src_rel}", tmp_path)
    before = tree_digest(step)
    out = tmp_path / "out" / step.name
    rc, text = _convert(step, f"--{scan}", "--target-from", FIXTURES / M / other, "--out", out)
    assert rc == 0, text
    assert "converted (maxtext)" in text
    assert tree_digest(step) == before  # the source step untouched, byte for byte
    # MaxText's own step of the written form: the same tree, shapes and dtypes (its RNG state
    # too: the unscanned model's one stream at layers_0, the scanned model's decoder/rngs).
    assert oml.read_specs(out / "items") == oml.read_specs(FIXTURES / M / other / "items")
    assert _custom(out)["scan_layers"] is (scan == "stack")
    assert oml.converted_provenance(out)["scan"] == scan
    assert _write_shapes_of_another_rank(out / "items") == []
    assert oml.verify_step(out).ok

    src, got = restore_flat(step / "items"), restore_flat(out / "items")
    stacked, flat = (src, got) if scan == "unroll" else (got, src)
    checked = set()
    for p, x in stacked.items():
        if not _in_layers(p):
            if p in flat:  # outside the layers: the same bytes (RNG state of one form only)
                assert raw(flat[p]).tobytes() == raw(x).tobytes(), p
                checked.add(p)
            continue
        for r in range(raw(x).shape[_axis(p)]):
            q = _unrolled(p, block, r)
            if q in flat:  # MaxText's unscanned model keeps its RNG stream at layers_0 only
                layer = np.take(raw(x), r, axis=_axis(p))
                assert raw(flat[q]).tobytes() == layer.tobytes(), (p, r)
                checked.add(q if scan == "unroll" else p)
    # Every weight and every Adam moment of the output was compared with the source.
    weights = {p for p in got if p[0] in ("params", "opt_state")}
    assert weights <= checked, sorted(weights - checked)[:5]


def test_cli_rescan_round_trip_verify_and_refusals(tmp_path):
    """The command as users run it (a process each): ``--unroll`` then ``--stack`` back,
    ``verify`` of both outputs; the refusals (no ``--out``; ``--stack`` onto an unscanned
    target without a scanned form) exit 2 and write nothing."""
    run = copy_fixture(f"{M}/pretrain_run", tmp_path)
    step = run / "checkpoints" / "1"
    before = tree_digest(run)
    unscanned = FIXTURES / M / "pretrain_unscanned_run" / "checkpoints" / "0"
    scanned = FIXTURES / M / "pretrain_run" / "checkpoints" / "1"

    res = cli("convert", str(step), "--unroll", "--target-from", str(unscanned), check_rc=2)
    assert "--out" in res.stderr and "never in place" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert tree_digest(run) == before and not (tmp_path / "unrolled").exists()

    out = tmp_path / "unrolled" / "1"
    res = cli("convert", str(step), "--unroll", "--target-from", str(unscanned), "--out", str(out))
    [report] = json.loads(
        cli(
            "convert",
            str(step),
            "--unroll",
            "--target-from",
            str(unscanned),
            "--out",
            str(out),
            "--json",
        ).stdout
    )
    assert report["status"] == "skipped"  # a rerun: the output exists
    assert tree_digest(run) == before

    back = tmp_path / "back" / "1"
    # Stacking onto an unscanned target alone cannot tell a plain scan from a block scan.
    res = cli(
        "convert",
        str(out),
        "--stack",
        "--target-from",
        str(unscanned),
        "--out",
        str(back),
        check_rc=2,
    )
    assert "--plain-scan" in res.stderr and not back.exists()
    res = cli("convert", str(out), "--stack", "--target-from", str(scanned), "--out", str(back))
    assert "converted (maxtext)" in res.stdout
    res = cli("verify", str(out.parent), "--json")
    assert [r["ok"] for r in json.loads(res.stdout)] == [True]
    assert json.loads(cli("verify", str(back.parent), "--json").stdout)[0]["ok"]
    # The round trip gives the source's weights and Adam state back, bit for bit.
    a, b = restore_flat(step / "items"), restore_flat(back / "items")
    assert sorted(a) == sorted(b)
    for p in a:
        if p[0] != "nnx_aux":  # the stack initialises the RNG state MaxText's unscanned lacks
            assert raw(a[p]).tobytes() == raw(b[p]).tobytes(), p


def test_without_a_scan_change_a_maxtext_step_is_skipped_as_before(tmp_path):
    step = copy_fixture(f"{M}/pretrain_run/checkpoints/1", tmp_path)
    target = FIXTURES / M / "pretrain_unscanned_run" / "checkpoints" / "0"
    for extra in ([], ["--out", str(tmp_path / "out")]):
        rc, text = _convert(step, "--target-from", target, *extra)
        assert rc == 0 and "skipped (already has items/)" in text, text
    assert not (tmp_path / "out").exists()


def test_api_refusals_write_nothing(tmp_path):
    step = copy_fixture(f"{M}/pretrain_unscanned_run/checkpoints/0", tmp_path)
    before = tree_digest(step)
    unscanned = oml.Target.from_checkpoint(step)
    scanned = oml.Target.from_checkpoint(FIXTURES / M / "pretrain_run" / "checkpoints" / "1")
    with pytest.raises(oml.UsageError, match="out=DIR"):
        oml.convert_step(step, scanned, rescan="stack")
    with pytest.raises(oml.UsageError, match="--plain-scan"):
        oml.convert_step(step, unscanned, rescan="stack", out=tmp_path / "a")
    with pytest.raises(oml.UsageError, match="unscanned already"):
        oml.convert_step(step, scanned, rescan="unroll", out=tmp_path / "b")
    assert tree_digest(step) == before
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # On the caller's word that the model is a plain scan: written, and the report says so.
    report = oml.convert_step(step, unscanned, rescan="stack", plain_scan=True, out=tmp_path / "c")
    assert rescan.GUESSED_SCAN in report.notes
    assert oml.verify_step(tmp_path / "c").ok


def test_a_tunix_step_converted_in_place_is_skipped_on_a_rerun(tmp_path):
    """A rerun of ``convert --unroll`` over a run it converted skips the steps it wrote
    (`rescans_items`): only MaxText's own steps need ``--out``."""
    run = copy_fixture(f"{M}/rl_run", tmp_path)
    unscanned = FIXTURES / M / "pretrain_unscanned_run" / "checkpoints" / "0"
    argv = ["convert", str(run / "checkpoints"), "--unroll", "--target-from", str(unscanned)]
    reports = json.loads(cli(*argv, "--json").stdout)
    assert [r["status"] for r in reports] == ["converted"]
    reports = json.loads(cli(*argv, "--json").stdout)
    assert [r["status"] for r in reports] == ["skipped"]


def test_verify_replays_against_the_recorded_source(tmp_path):
    """``verify`` compares every leaf with the source the output records: pointed at another
    step of the same run (same tree, other values), it fails, naming the leaves."""
    run = copy_fixture(f"{M}/pretrain_run", tmp_path)
    target = oml.Target.from_checkpoint(FIXTURES / M / "pretrain_unscanned_run/checkpoints/0")
    out = tmp_path / "out" / "1"
    oml.convert_step(run / "checkpoints" / "1", target, rescan="unroll", out=out)
    assert oml.verify_step(out).ok
    meta = json.loads((out / "_CHECKPOINT_METADATA").read_text())
    prov = meta["custom_metadata"]["orbax_maxtext_layout"]
    assert prov["source"] == str((run / "checkpoints" / "1").resolve())
    prov["source"] = str(run / "checkpoints" / "0")
    (out / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    result = oml.verify_step(out)
    assert not result.ok
    assert any(
        "params/params/decoder/layers_1/mlp/wo/kernel: value differs" in p for p in result.problems
    ), result.problems[:3]


def test_drop_optimizer_and_a_target_without_one(tmp_path):
    """``optimizer="drop"`` writes params, nnx_aux and step only; a target without an
    optimizer (``without_optimizer``) takes the step's own, each moment re-sliced on its
    Param's axis."""
    step = copy_fixture(f"{M}/pretrain_run/checkpoints/1", tmp_path)
    mt = FIXTURES / M / "pretrain_unscanned_run" / "checkpoints" / "0"
    want = oml.read_specs(mt / "items")
    target = oml.Target.from_checkpoint(mt)
    oml.convert_step(step, target, rescan="unroll", optimizer="drop", out=tmp_path / "a")
    assert oml.read_specs(tmp_path / "a" / "items") == {
        p: s for p, s in want.items() if p[0] != "opt_state"
    }
    assert oml.verify_step(tmp_path / "a").ok
    bare = target.without_optimizer()
    oml.convert_step(step, bare, rescan="unroll", out=tmp_path / "b")
    assert oml.read_specs(tmp_path / "b" / "items") == want
    assert oml.verify_step(tmp_path / "b").ok


def test_a_tunix_unroll_against_a_target_without_an_optimizer(tmp_path):
    """The moments of a Tunix step unroll on their Params' axes where the target names no
    optimizer (an AssertionError before `rescan.layer_axis`)."""
    scanned = oml.Target.from_checkpoint(FIXTURES / "maxtext_native/run/checkpoints/2")
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    report = oml.convert_step(step, oml.unroll_target(scanned.without_optimizer()), rescan="unroll")
    assert report.status == "converted"
    got = oml.read_specs(step / "items")
    mu = [p for p in got if p[0] == "opt_state" and "mu" in p and "layers_2" in p]
    assert len(mu) == 9 and oml.verify_step(step).ok


def test_a_param_only_step_stays_param_only(tmp_path):
    """merge-lora's output (params only) unrolled: no RNG state made up, no optimizer."""
    base = copy_fixture(f"{M}/pretrain_run/checkpoints/1", tmp_path)
    adapters = copy_fixture(f"{M}/lora_run/checkpoints/2", tmp_path)
    oml.merge_lora(adapters, base, alpha=8, out=tmp_path / "merged")
    merged = tmp_path / "merged" / "0"
    target = oml.Target.from_checkpoint(FIXTURES / M / "pretrain_unscanned_run/checkpoints/0")
    oml.convert_step(merged, target, rescan="unroll", out=tmp_path / "unrolled" / "0")
    got = oml.read_specs(tmp_path / "unrolled" / "0" / "items")
    assert {p[:2] for p in got} == {("params", "params")}
    assert {p[2:] for p in got} == set(target.params)
    assert oml.verify_step(tmp_path / "unrolled" / "0").ok


def test_a_source_item_beside_items_is_named_not_carried(tmp_path):
    """A step's other items (a Grain ``iter``) are not MaxText items leaves: the new step's
    metadata names only ``items``, and the report says what was left behind."""
    step = copy_fixture(f"{M}/pretrain_run/checkpoints/1", tmp_path)
    (step / "iter").mkdir()
    (step / "iter" / "process_0-of-1.json").write_text("{}")
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    meta["item_handlers"]["iter"] = "grain"
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    target = oml.Target.from_checkpoint(FIXTURES / M / "pretrain_unscanned_run/checkpoints/0")
    report = oml.convert_step(step, target, rescan="unroll", out=tmp_path / "out")
    assert any("iter/ not carried" in n for n in report.notes), report.notes
    written = json.loads((tmp_path / "out" / "_CHECKPOINT_METADATA").read_text())
    assert set(written["item_handlers"]) == {"items"}
    assert not (tmp_path / "out" / "iter").exists()
    shutil.rmtree(step / "iter")
