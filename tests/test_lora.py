"""LoRA adapter steps: named from metadata, refused wherever they would be dropped, merged.

Real Orbax checkpoints only: the frozen google-tunix 0.1.7 LoRA step and MaxText base of the
same model, plus llama-shaped bases and adapters written here by Orbax (`lora_writers`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MAXTEXT_NATIVE, copy_fixture, raw, restore_flat, tree_digest
from lora_writers import (
    base_params,
    expected_merge,
    kernels,
    lora_factors,
    write_adapters,
    write_base,
)

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import keystr
from orbax_maxtext_layout.cli import main as cli

LORA_STEP = "tunix017/sft_lora_run/checkpoints/1"
PP = ("params", "params")


def _run(argv, capsys):
    code = cli([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _llama(tmp_path, *, axis=1, dtype=np.float32, rank=4, layers=3, alpha=8.0, custom=None):
    base = base_params(layers=layers, axis=axis, dtype=dtype)
    factors = lora_factors(layers=layers, axis=axis, rank=rank)
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, factors, custom=custom)
    return base, factors, b, a


def _params(step_dir) -> dict:
    return {p[2:]: v for p, v in restore_flat(Path(step_dir) / "items").items() if p[:2] == PP}


def _stored(x) -> np.ndarray:
    return np.asarray(x)


# -- 1. named ---------------------------------------------------------------------------
def test_inspect_names_lora_adapters(tmp_path, capsys):
    step = copy_fixture(LORA_STEP, tmp_path)
    code, out, _ = _run(["inspect", step.parent, "--json"], capsys)
    assert code == 0
    [entry] = json.loads(out)
    lo = entry["lora"]
    assert lo["rank"] == 2 and lo["layer_axis"] == 1 and lo["num_layers"] == 3
    assert lo["scanned"] and lo["dtype"] == "float32" and lo["base_weights"] is False
    assert lo["leaves"] == 14 and lo["alpha"] is None
    assert "decoder/layers/self_attention/out" in lo["modules"] and len(lo["modules"]) == 7
    code, out, _ = _run(["inspect", step.parent], capsys)
    assert "LoRA adapters: rank 2" in out and "holds no base weights" in out
    # find_steps carries the same facts; a full step is not LoRA.
    [info] = oml.find_steps(step.parent)
    assert info.lora is not None and info.lora.rank == 2 and info.lora.modules == lo["modules"]
    full = copy_fixture("tunix017/sft_run/checkpoints/1", tmp_path / "full")
    assert oml.find_steps(full)[0].lora is None
    code, out, _ = _run(["inspect", full, "--json"], capsys)
    assert json.loads(out)[0]["lora"] is None


def test_alpha_recorded_by_maxtext_is_read(tmp_path):
    custom = {"lora": {"enable_lora": True, "lora_rank": 4, "lora_alpha": 16.0}}
    *_, a = _llama(tmp_path, custom=custom)
    assert oml.find_steps(a)[0].lora.alpha == 16.0


# -- 2. never dropped silently ------------------------------------------------------------
def _assert_refusal(err: str, step) -> None:
    assert "LoRA adapter step" in err and "no base weights" in err, err
    assert "merge-lora" in err and f"lora.lora_restore_path={step}/model_params" in err, err
    assert "rank 2" in err and "decoder/layers/mlp/wo" in err, err


@pytest.mark.parametrize("dry_run", [False, True])
def test_convert_refuses_lora_step(tmp_path, capsys, dry_run):
    step = copy_fixture(LORA_STEP, tmp_path)
    before = tree_digest(step.parent)
    argv = ["convert", step.parent, "--target-from", MAXTEXT_NATIVE] + (
        ["--dry-run"] if dry_run else []
    )
    code, out, err = _run(argv, capsys)
    assert code == 1
    _assert_refusal(out, step)
    assert "LoraAdapterStepError" in err
    code, out, _ = _run([*argv, "--json"], capsys)
    [report] = json.loads(out)
    assert report["status"] == "failed" and report["lora"]["rank"] == 2
    assert len(report["lora"]["modules"]) == 7 and report["lora"]["base_weights"] is False
    assert tree_digest(step.parent) == before  # nothing read into items, written or moved
    assert sorted(p.name for p in step.parent.iterdir()) == ["1"]


def test_restore_paths_refuse_lora_step(tmp_path):
    step = copy_fixture(LORA_STEP, tmp_path)
    before = tree_digest(step.parent)
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    abstract = target.items()
    params_only = {"params": abstract["params"]}
    step_only = {"step": abstract["step"]}  # MaxText pre-training's LoRA-filtered target
    with pytest.raises(oml.LoraAdapterStepError) as e:
        ocp.Checkpointer(oml.MaxTextLayoutHandler()).restore(
            step, args=oml.MaxTextLayoutRestore(item=abstract)
        )
    _assert_refusal(str(e.value), step)
    with pytest.raises(oml.LoraAdapterStepError):
        oml.load_params_from_path(str(step / "model_params"), params_only["params"])
    for item, partial in ((abstract, False), (params_only, True), (step_only, True)):
        with oml.CheckpointManager(step.parent, item_handlers=("items",)) as mngr:
            with pytest.raises(oml.LoraAdapterStepError):
                mngr.restore(
                    0,
                    args=ocp.args.Composite(
                        items=ocp.args.PyTreeRestore(item=item, partial_restore=partial)
                    ),
                )
    with pytest.raises(oml.LoraAdapterStepError):
        oml.plan_step(step, oml.Target({}, {}), unnamed="skip")
    assert tree_digest(step.parent) == before


def test_v1_checkpointer_refuses_lora_step(tmp_path):
    import orbax.checkpoint.experimental.v1 as ocp1

    from orbax_maxtext_layout import training

    step = copy_fixture(LORA_STEP, tmp_path)
    before = tree_digest(step.parent)
    abstract = oml.Target.from_checkpoint(MAXTEXT_NATIVE).items()
    ctx = ocp1.Context(
        pytree_options=ocp1.options.PyTreeOptions(
            loading=ocp1.options.PyTreeOptions.Loading(partial_load=True)
        )
    )
    ckpt = training.Checkpointer(step.parent)
    try:
        assert ckpt.latest.step == 0
        with ctx, pytest.raises(oml.LoraAdapterStepError):
            ckpt.load_checkpointables(0, {"items": {"step": abstract["step"]}})
    finally:
        ckpt.close()
    assert tree_digest(step.parent) == before


def test_a_target_with_the_adapters_still_converts(tmp_path):
    """A qwix-applied model's target holds the factors: nothing is refused (as before)."""
    step = copy_fixture(LORA_STEP, tmp_path)
    specs = oml.read_specs(step / "model_params")
    target = oml.Target(
        {p[:-1]: s for p, s in specs.items()},
        {},
        abstract={PP + p[:-1]: s.abstract() for p, s in specs.items()},
    )
    report = oml.convert_step(step, target, optimizer="drop")
    assert report.status == "converted" and report.destinations["params"]["leaves"] == 14


def test_request_naming_no_weight_is_refused_unless_partial(tmp_path):
    step = copy_fixture("tunix017/sft_run/checkpoints/1", tmp_path)
    abstract = oml.Target.from_checkpoint(MAXTEXT_NATIVE).items()
    handler = oml.MaxTextLayoutHandler()
    with pytest.raises(oml.LayoutMismatchError, match="names none of the 42 model leaves"):
        ocp.Checkpointer(handler).restore(
            step, args=oml.MaxTextLayoutRestore(item={"step": abstract["step"]})
        )
    got = ocp.Checkpointer(handler).restore(
        step,
        args=oml.MaxTextLayoutRestore(item={"step": abstract["step"]}, partial_restore=True),
    )
    assert int(got["step"]) == 1


def test_hints_say_what_differs(tmp_path):
    """'scan form differs' only when it does; 'same model config' only for a model."""
    step = copy_fixture("tunix017/sft_run/checkpoints/1", tmp_path)
    empty = oml.Target({}, {}, abstract={("step",): jax.ShapeDtypeStruct((), np.int32)})
    with pytest.raises(oml.LayoutMismatchError) as e:
        oml.plan_step(step, empty)
    assert "names no model leaves" in e.value.hint and "scan form" not in e.value.hint
    native = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    smaller = oml.Target({p: s for p, s in native.params.items() if "mlp" not in p}, native.nnx_aux)
    with pytest.raises(oml.LayoutMismatchError) as e:
        oml.plan_step(step, smaller)
    assert "same model config" in e.value.hint
    unrolled = oml.unroll_target(native)
    with pytest.raises(oml.LayoutMismatchError) as e:
        oml.plan_step(step, unrolled)
    assert "scan form differs" in e.value.hint


# -- 3. merged ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "axis,dtype",
    [(1, np.float32), (0, np.float32), (None, np.float32), (1, ml_dtypes.bfloat16)],
    ids=["axis1", "axis0", "unscanned", "bf16"],
)
def test_merge_lora(tmp_path, capsys, axis, dtype):
    base, factors, b, a = _llama(tmp_path, axis=axis, dtype=dtype)
    out = tmp_path / "merged"
    # bf16: a budget below the kernel's size, so each layer is read on its own
    budget = ["--memory-budget", "1"] if dtype is not np.float32 else []
    code, text, err = _run(
        ["merge-lora", a, "--base", b, "--alpha", 8, "--out", out, "--json", *budget], capsys
    )
    assert code == 0, err
    report = json.loads(text)
    assert report["rank"] == 4 and report["scale"] == 2.0 and report["layer_axis"] == axis
    got = _params(out / "0")
    want = expected_merge(base, factors, 8.0, 4, axis)
    assert set(got) == set(want)
    for p, w in want.items():
        assert got[p].dtype == w.dtype and got[p].shape == w.shape, p
        if p[-1] == "kernel":
            assert not np.array_equal(_stored(got[p]), base[p]), p  # really merged
        assert np.array_equal(_stored(got[p]).view(np.uint8), w.view(np.uint8)), keystr(p)
    # Only params; provenance; stock Orbax reads it; verify replays it.
    items = restore_flat(out / "0" / "items")
    assert {p[0] for p in items} == {"params"}
    prov = oml.converted_provenance(out / "0")
    assert prov["alpha"] == 8.0 and prov["rank"] == 4 and prov["scan_axis"] == axis
    assert prov["base"] == str(b) and prov["adapter_step"] == str(a)
    assert len(prov["modules"]) == (4 if axis is not None else 12)  # unscanned: per layer
    assert oml.verify_step(out / "0").ok
    assert ocp.CheckpointManager(out).all_steps() == [0]


def _moe_step(tmp_path, layers: int = 2, experts: int = 3, emb: int = 8, mlp: int = 6, r: int = 4):
    """A mixtral-like block (gemma3-like block scan around it): experts stacked with the
    layers, and qwix's einsum factors (its ``LoraProvider.einsum``): ``wi_0`` (E, L, emb, mlp)
    gets ``a`` (emb, L, r) and ``b`` (r, L, E, mlp); ``wo`` (E, L, mlp, emb) gets ``a``
    (E, L, mlp, r) and ``b`` (r, L, emb); a dense kernel (emb, L, mlp) the usual pair."""
    rng = np.random.default_rng(7)
    blk = ("decoder", "layers", "layers_0")

    def n(*shape):
        return rng.normal(size=shape).astype(np.float32)

    base = {
        (*blk, "MoeBlock_0", "wi_0"): n(experts, layers, emb, mlp),
        (*blk, "MoeBlock_0", "wo"): n(experts, layers, mlp, emb),
        (*blk, "mlp", "wi", "kernel"): n(emb, layers, mlp),
        ("token_embedder", "embedding"): n(16, emb),
    }
    factors = {
        (*blk, "MoeBlock_0", "wi_0_lora_a"): n(emb, layers, r),
        (*blk, "MoeBlock_0", "wi_0_lora_b"): n(r, layers, experts, mlp),
        (*blk, "MoeBlock_0", "wo_lora_a"): n(experts, layers, mlp, r),
        (*blk, "MoeBlock_0", "wo_lora_b"): n(r, layers, emb),
        (*blk, "mlp", "wi", "kernel_lora_a"): n(emb, layers, r),
        (*blk, "mlp", "wi", "kernel_lora_b"): n(r, layers, mlp),
    }
    return base, factors


def test_merge_of_moe_expert_adapters_follows_qwix_einsum(tmp_path, capsys):
    """Each layer's delta is qwix's own einsum of the factors (its lora_einsum_str, written
    out here for each weight), in the weight's dim order: not a reshape."""
    base, factors = _moe_step(tmp_path)
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, factors)
    out = tmp_path / "merged"
    code, _, err = _run(["merge-lora", a, "--base", b, "--alpha", 8, "--out", out], capsys)
    assert code == 0, err
    got = _params(out / "0")
    blk = ("decoder", "layers", "layers_0")
    scale = 8.0 / 4
    eq = {  # x's dims of the weight first, then r; the rest after r (qwix's split)
        ("MoeBlock_0", "wi_0"): "mr,rEh->Emh",
        ("MoeBlock_0", "wo"): "Emr,rh->Emh",
        ("mlp", "wi", "kernel"): "mr,rh->mh",
    }
    for mod, spec in eq.items():
        w = base[(*blk, *mod)]
        fa = factors[(*blk, *mod[:-1], f"{mod[-1]}_lora_a")]
        fb = factors[(*blk, *mod[:-1], f"{mod[-1]}_lora_b")]
        want = np.stack(
            [
                w.take(i, 1) + scale * np.einsum(spec, fa.take(i, 1), fb.take(i, 1))
                for i in range(w.shape[1])
            ],
            axis=1,
        )
        np.testing.assert_allclose(got[(*blk, *mod)], want, rtol=1e-5, atol=1e-5)
        assert not np.allclose(got[(*blk, *mod)], w)
    assert oml.verify_step(out / "0").ok
    # Unrolled too: each layer of the block scan under MaxText's unscanned name.
    code, _, err = _run(
        ["merge-lora", a, "--base", b, "--alpha", 8, "--out", tmp_path / "u", "--unroll"], capsys
    )
    assert code == 0, err
    flat = _params(tmp_path / "u" / "0")
    np.testing.assert_array_equal(
        flat[("decoder", "layers_1", "MoeBlock_0", "wi_0")], got[(*blk, "MoeBlock_0", "wi_0")][:, 1]
    )


def test_delta_layouts_place_each_factor_dim_or_refuse_when_shapes_cannot_tell():
    from orbax_maxtext_layout.model.lora import delta_layouts

    assert delta_layouts((8, 2, 4), (8, 3), (3, 8)) == [()]  # a dense kernel: a reshape
    assert delta_layouts((3, 8, 6), (8, 4), (4, 3, 6)) == [(1, 0, 2)]  # wi_0: experts in b
    assert delta_layouts((3, 6, 8), (3, 6, 4), (4, 8)) == [()]  # wo: a split, no reshape
    assert delta_layouts((3, 8, 6), (8, 4), (4, 3, 5)) == []  # does not fit
    # as many experts as the input dim: the a-dim could be either of the first two
    assert len(delta_layouts((4, 4, 6), (4, 2), (2, 4, 6))) == 2


@pytest.mark.parametrize(
    "budget", [1 << 30, 14 << 20, 8 << 20], ids=["roomy", "one-kernel-at-a-time", "below-a-kernel"]
)
@pytest.mark.parametrize("axis", [1, 0])
def test_merge_of_large_kernels_decodes_each_stored_chunk_once(tmp_path, axis, budget):
    """Kernels of several MiB (zstandard's path, each one stored chunk): each stored chunk
    is decoded once and merged piece by piece, whatever the budget (a kernel larger than
    the budget too: never layer by layer, which decodes the chunk once per layer). The
    merge is right either way."""
    from orbax_maxtext_layout.orbax_io.orbax_files import io_counts

    shapes = kernels(emb=512, heads=8, head_dim=128, mlp=2048)  # 6 to 12 MiB kernels
    base = base_params(layers=3, axis=axis, shapes=shapes)
    factors = lora_factors(layers=3, axis=axis, shapes=shapes)
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, factors)
    with io_counts() as counts:
        oml.merge_lora(a, b, alpha=8, out=tmp_path / "m", memory_budget=budget)
    got = _params(tmp_path / "m" / "0")
    want = expected_merge(base, factors, 8.0, 4, axis)
    for p, w in want.items():
        if p[-1] != "kernel":
            continue
        assert np.abs(w - base[p]).max() > 1e-2, p  # the adapters move it
        np.testing.assert_allclose(got[p], w, rtol=1e-6, atol=1e-6, err_msg=keystr(p))
        name = f"{b}/items/" + ".".join(PP + p)
        decoded = [
            n for (kind, k), n in counts.items() if kind == "chunk decoded" and k.startswith(name)
        ]
        assert decoded and set(decoded) == {1}, (p, decoded)
        assert counts[("layer decoded", name)] == counts[("array decoded", name)] == 0, p
    assert oml.verify_step(tmp_path / "m" / "0").ok


@pytest.mark.parametrize("which", ["mlp.wo", "self_attention.query"])
def test_a_damaged_kernel_stops_the_merge_naming_it(tmp_path, which):
    """A kernel whose stored chunk is cut short fails its decode (on a worker's thread,
    while other kernels are merged): the merge stops with an error naming it, promptly, and
    leaves no step."""
    import threading

    from orbax_maxtext_layout.errors import CheckpointReadError
    from orbax_maxtext_layout.orbax_io import (
        item_writer,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    shapes = kernels(emb=512, heads=8, head_dim=128, mlp=2048)
    b = write_base(tmp_path / "base", 0, base_params(layers=3, shapes=shapes))
    a = write_adapters(tmp_path / "sft", 2, lora_factors(layers=3, shapes=shapes))
    src = ItemReader.open(b / "items", item_writer.ts_context())
    name = f"params.params.decoder.layers.{which}.kernel"
    lay = src.layout(name)
    key = lay.key((0,) * len(lay.shape))
    raw = src.kv.read(f"{name}/{key}").result().value
    src.kv.write(f"{name}/{key}", raw[: len(raw) // 2]).result()
    failure: list = []

    def merge():
        try:
            oml.merge_lora(a, b, alpha=8, out=tmp_path / "m", memory_budget=14 << 20)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=merge, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the merge hung after a failed decode"
    [e] = failure
    assert isinstance(e, CheckpointReadError) and name in str(e), e
    assert not (tmp_path / "m").exists() or ocp.CheckpointManager(tmp_path / "m").all_steps() == []


def test_merge_copies_unmerged_leaves_as_stored_bytes(tmp_path):
    """Unadapted params are grafted (their base data files linked, never decoded), so their
    stored chunks are the base's, byte for byte; and verify catches a wrong merged value."""
    from orbax_maxtext_layout.orbax_io import item_writer, ocdbt
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    base, _factors, b, a = _llama(tmp_path)
    out = tmp_path / "merged"
    oml.merge_lora(a, b, alpha=8, out=out)
    ctx = item_writer.ts_context()
    src = ItemReader.open(b / "items", ctx)
    dst = ItemReader.open(out / "0" / "items", ctx)
    name = "params.params.token_embedder.embedding"
    sk, dk = ocdbt.keys(src.kv, name), ocdbt.keys(dst.kv, name)
    assert sk and [src.kv.read(k).result().value for k in sk] == [
        dst.kv.read(k).result().value for k in dk
    ]
    linked = [f for f in (out / "0" / "items").rglob("*") if f.is_file() and f.stat().st_nlink > 1]
    assert linked  # the base's data files, shared by hard link
    # verify replays the merge: a base changed afterwards no longer matches.
    assert oml.verify_step(out / "0").ok
    base2 = dict(base)
    kp = ("decoder", "layers", "mlp", "wo", "kernel")
    base2[kp] = base[kp] + 1
    write_base(tmp_path / "other", 0, base2)
    prov_file = out / "0" / "_CHECKPOINT_METADATA"
    meta = json.loads(prov_file.read_text())
    meta["custom_metadata"]["orbax_maxtext_layout"]["base"] = str(tmp_path / "other" / "0")
    prov_file.write_text(json.dumps(meta))
    res = oml.verify_step(out / "0")
    assert not res.ok and any("mlp/wo/kernel" in p for p in res.problems), res


def test_merge_unroll_and_stack(tmp_path):
    base, factors, b, a = _llama(tmp_path, axis=1)
    oml.merge_lora(a, b, alpha=8, out=tmp_path / "flat", scan="unroll")
    got = _params(tmp_path / "flat" / "0")
    want = expected_merge(base, factors, 8.0, 4, 1)
    for p, w in want.items():
        if "layers" not in p:
            assert np.array_equal(got[p], w)
            continue
        for i in range(3):
            q = tuple(f"layers_{i}" if k == "layers" else k for k in p)
            assert np.array_equal(got[q], np.take(w, i, 1)), q
    assert oml.verify_step(tmp_path / "flat" / "0").ok
    # Unscanned adapters over an unscanned base, written stacked on axis 1.
    ubase, ufactors, ub, ua = _llama(tmp_path / "u", axis=None)
    # No scanned form at hand: refused unless the caller says the model is a plain scan.
    with pytest.raises(oml.UsageError, match="--plain-scan"):
        oml.merge_lora(ua, ub, alpha=8, out=tmp_path / "stacked", scan="stack")
    assert not (tmp_path / "stacked").exists()
    oml.merge_lora(ua, ub, alpha=8, out=tmp_path / "stacked", scan="stack", plain_scan=True)
    got = _params(tmp_path / "stacked" / "0")
    want = expected_merge(ubase, ufactors, 8.0, 4, None)
    for p, w in got.items():
        if "layers" in p:
            for i in range(3):
                q = tuple(f"layers_{i}" if k == "layers" else k for k in p)
                assert np.array_equal(np.take(w, i, 1), want[q]), q
    assert oml.verify_step(tmp_path / "stacked" / "0").ok
    # A target given with a MaxText base (as --maxtext-config gives one) only names the other
    # scan form: the merge is the same, and verify replays it without the target.
    target = oml.Target.from_checkpoint(b)
    oml.merge_lora(a, b, alpha=8, out=tmp_path / "given", scan="unroll", target=target)
    assert _params(tmp_path / "given" / "0").keys() == _params(tmp_path / "flat" / "0").keys()
    assert oml.verify_step(tmp_path / "given" / "0").ok


def test_merge_into_the_real_fixture_base(tmp_path):
    """The frozen Tunix 0.1.7 LoRA step (llama module names, rank 2) over MaxText's own step
    of the same model, checked against the math done here per layer."""
    step = copy_fixture(LORA_STEP, tmp_path)
    r = oml.merge_lora(step, MAXTEXT_NATIVE / "items", alpha=4, out=tmp_path / "m")
    assert r.layer_axis == 1 and len(r.merged) == 7
    got = _params(tmp_path / "m" / "0")
    base = {
        p[2:]: np.asarray(v)
        for p, v in restore_flat(MAXTEXT_NATIVE / "items").items()
        if p[:2] == PP
    }
    lora = {p[:-1]: np.asarray(v) for p, v in restore_flat(step / "model_params").items()}
    want = expected_merge(base, lora, 4.0, 2, 1)
    for p, w in want.items():
        np.testing.assert_array_equal(got[p], w, err_msg=keystr(p))


def test_merge_into_a_full_tunix_base(tmp_path, capsys):
    """A full Tunix step of the same model as the base: its weights (not its RNG state,
    which only the target tells apart) are merged and written as MaxText params."""
    step = copy_fixture(LORA_STEP, tmp_path)
    base = copy_fixture("tunix017/sft_run/checkpoints/1", tmp_path / "b")
    err = _refused(tmp_path, capsys, step, base, "--alpha", 4, code=2)
    assert "only the model tells them apart" in err and "--target-from" in err
    code, _, err = _run(
        [
            "merge-lora",
            step,
            "--base",
            base,
            "--alpha",
            4,
            "--out",
            tmp_path / "m",
            "--target-from",
            MAXTEXT_NATIVE,
        ],
        capsys,
    )
    assert code == 0, err
    got = _params(tmp_path / "m" / "0")
    stored = {p: raw(v) for p, v in restore_flat(base / "model_params").items()}
    weights = {
        p[:-1]: v
        for p, v in stored.items()
        if p[:-1] in oml.Target.from_checkpoint(MAXTEXT_NATIVE).params
    }
    assert len(weights) == 12 and set(got) == set(weights)
    lora = {p[:-1]: np.asarray(v) for p, v in restore_flat(step / "model_params").items()}
    want = expected_merge(weights, lora, 4.0, 2, 1)
    for p, w in want.items():
        np.testing.assert_array_equal(got[p], w, err_msg=keystr(p))
    assert oml.verify_step(tmp_path / "m" / "0").ok


def _refused(tmp_path, capsys, a, b, *extra, code=1):
    out = tmp_path / "refused"
    rc, text, err = _run(["merge-lora", a, "--base", b, "--out", out, *extra], capsys)
    assert rc == code, (text, err)
    assert not out.exists() or not any(out.iterdir())
    return err


def test_merge_refusals(tmp_path, capsys):
    base, _factors, b, a = _llama(tmp_path)
    # alpha neither given nor recorded: usage error naming alpha
    err = _refused(tmp_path, capsys, a, b, code=2)
    assert "alpha" in err
    # adapters for a module the base lacks
    nb = {p: v for p, v in base.items() if "wo" not in p}
    err = _refused(tmp_path, capsys, a, write_base(tmp_path / "nowo", 0, nb), "--alpha", 8)
    assert "decoder/layers/mlp/wo: adapters (lora_a float32[32, 3, 4]" in err and "has no" in err
    # factors whose product does not fit the kernel (another model size)
    other = base_params(layers=3, axis=1)
    kp = ("decoder", "layers", "mlp", "wi_0", "kernel")
    other[kp] = np.zeros((16, 3, 48), np.float32)
    err = _refused(tmp_path, capsys, a, write_base(tmp_path / "size", 0, other), "--alpha", 8)
    assert (
        "decoder/layers/mlp/wi_0: factors (lora_a float32[16, 3, 4], lora_b float32[4, 3, 32])"
        in err
    )
    assert "float32[16, 3, 48]" in err
    # a base of another model (other layer count): every module named
    err = _refused(
        tmp_path, capsys, a, write_base(tmp_path / "l4", 0, base_params(layers=4)), "--alpha", 8
    )
    assert err.count("do not fit base kernel") == 4
    # a quantized base kernel
    q = dict(base)
    q[kp] = q[kp].astype(np.int8)
    err = _refused(tmp_path, capsys, a, write_base(tmp_path / "q", 0, q), "--alpha", 8)
    assert "quantized" in err and "decoder/layers/mlp/wi_0" in err
    # a step that is not a LoRA step
    full = copy_fixture("tunix017/sft_run/checkpoints/1", tmp_path / "full")
    err = _refused(tmp_path, capsys, full, b, "--alpha", 8)
    assert "not a LoRA adapter step" in err and "token_embedder/embedding/value" in err


def test_merge_dry_run_writes_nothing(tmp_path, capsys):
    _, _, b, a = _llama(tmp_path)
    code, text, _ = _run(
        ["merge-lora", a, "--base", b, "--alpha", 8, "--out", tmp_path / "o", "--dry-run"], capsys
    )
    assert code == 0 and "dry-run" in text and "4 merged" in text
    assert not (tmp_path / "o").exists()


_KILLED_MERGE = textwrap.dedent(
    """
    import sys, time
    import orbax_maxtext_layout as oml
    print("ready", flush=True)
    t = time.monotonic()
    oml.merge_lora(sys.argv[1], sys.argv[2], alpha=8, out=sys.argv[3], memory_budget=1 << 20)
    print(time.monotonic() - t, flush=True)
    """
)


def _merge_child(a, b, out):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", _KILLED_MERGE, a, b, out]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow  # the slow pass (.ci/run): a kill campaign
def test_sigkill_during_merge_leaves_nothing_listed(tmp_path):
    """A merge killed at a seeded random moment of its work leaves no listable step under
    --out (only a complete one); a rerun completes."""
    _base, _factors, b, a = _llama(tmp_path, layers=8)
    proc = _merge_child(a, b, tmp_path / "timing")
    work = float(proc.stdout.readline())  # seconds of merging, after the imports
    assert proc.wait() == 0
    rng = np.random.default_rng(0)
    killed_before_commit = left_behind = 0
    for n in range(8):
        out = tmp_path / f"out{n}"
        proc = _merge_child(a, b, out)
        time_to_kill = float(rng.uniform(0.0, 1.1 * work))
        try:
            proc.wait(timeout=time_to_kill)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        steps = ocp.CheckpointManager(out).all_steps() if out.exists() else []
        done = (out / "0" / "items" / "commit_success.txt").exists()
        assert steps == ([0] if done else []), steps
        killed_before_commit += not done
        tmp = [c.name for c in out.glob("*.orbax-checkpoint-tmp*")]  # (out may not exist)
        left_behind += bool(tmp)
        if not done:  # the rerun completes over whatever the kill left
            oml.merge_lora(a, b, alpha=8, out=out)
        assert oml.verify_step(out / "0").ok
        # ... and removes what the dead merge was building
        assert not list(out.glob("*.orbax-checkpoint-tmp*")), tmp
    assert killed_before_commit >= 2  # the kills did land inside the work
    assert left_behind >= 1  # and some left a half-built step for the rerun to remove


@pytest.mark.parametrize("budget", [1 << 30, 8 << 20], ids=["roomy", "below-a-kernel"])
def test_merge_with_factors_past_the_small_size_keeps_the_base_piece(tmp_path, budget):
    """Rank-192 factors (1.2 to 2.4 MiB: zstandard's path, as a rank-16 adapter of an 8B
    model is) are read while a piece of their base is held in the worker's decode buffer:
    reading them must not overwrite that piece (it did: the first piece of each base merged
    with factor bytes in place of its own)."""
    shapes = kernels(emb=512, heads=8, head_dim=128, mlp=2048)
    base = base_params(layers=3, axis=1, shapes=shapes)
    factors = lora_factors(layers=3, axis=1, rank=192, scale=0.01, shapes=shapes)
    small = [x.nbytes for p, x in factors.items() if x.nbytes <= 1 << 20]
    assert not small, small  # every factor is streamed, not read by tensorstore
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, factors)
    oml.merge_lora(a, b, alpha=8, out=tmp_path / "m", memory_budget=budget)
    got = _params(tmp_path / "m" / "0")
    want = expected_merge(base, factors, 8.0, 192, 1)
    for p, w in want.items():
        if p[-1] == "kernel":
            np.testing.assert_allclose(got[p], w, rtol=1e-5, atol=1e-5, err_msg=keystr(p))
