"""A PEFT adapter written as the Tunix LoRA step ``train_sft`` resumes from (issue 60,
``import-hf --adapter --as-lora``): `lora.peft_as_lora`, without MaxText.

The adapter directories are written as PEFT writes them (``adapter_config.json``,
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A/B.weight``), opened as
the import opens them (`HfDir`, `peft_adapter.settings`, `peft_adapter.plan_adapter`) and
written with `peft_as_lora.factors` and `write_step`. MaxText's mapping is what the import
brings (interop: tests/interop/test_import_adapter.py runs the command, MaxText's LoRA model
restored from the step and ``train_sft`` resuming from it); here each weight's hook is the
llama import hook written out in NumPy: the transpose of an ``(out, in)`` tensor into the
kernel's dims, the query's head rows permuted (RoPE's order) and scaled by ``1/sqrt(head_dim)``.

The step is read back with stock Orbax (``PyTreeCheckpointer``), and every layer's
``(alpha/rank) · reshape(a @ b)`` is checked against the hook of PEFT's own ``s · B @ A``
computed here from the files (float64), so a wrong scale, a rank not padded, a layer out of
place or a hook not carried fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import stock_restore
from safetensors.numpy import save_file

from orbax_maxtext_layout.errors import StepExistsError
from orbax_maxtext_layout.formats.safetensors_reader import HfDir
from orbax_maxtext_layout.hf.hooks_by_box import PieceFn
from orbax_maxtext_layout.lora import peft_adapter as P
from orbax_maxtext_layout.lora import peft_as_lora as A
from orbax_maxtext_layout.lora.export_adapter import _recorded
from orbax_maxtext_layout.lora.merge_plan import adapter_item, read_adapters

E, H, D, M, L = 16, 2, 8, 32, 3  # emb, heads, head_dim, mlp, layers
HF = {  # module -> (HF (out, in), kernel of one layer, MaxText path)
    "self_attn.q_proj": ((H * D, E), (E, H, D), "self_attention/query"),
    "self_attn.v_proj": ((H * D, E), (E, H, D), "self_attention/value"),
    "self_attn.o_proj": ((E, H * D), (H, D, E), "self_attention/out"),
    "mlp.gate_proj": ((M, E), (E, M), "mlp/wi_0"),
    "mlp.down_proj": ((E, M), (M, E), "mlp/wo"),
}
BASE = {f"model.layers.{i}.{m}.weight": s for i in range(L) for m, (s, _, _) in HF.items()}
BASE |= {"lm_head.weight": (64, E)}
PERM = np.concatenate([np.r_[0:D:2], np.r_[1:D:2]])  # a head's rows, as MaxText's RoPE orders them


def hook(module: str):
    (out, n_in), kernel, _ = HF[module]

    def fn(m: np.ndarray) -> np.ndarray:
        m = np.asarray(m, np.float64)
        if module == "self_attn.q_proj":
            m = m.reshape(H, D, E)[:, PERM].reshape(out, n_in) / math.sqrt(D)
        return m.T.reshape(kernel)

    return fn


def traced_hook(module: str):
    """`hook` as MaxText writes its hooks, in JAX ops `hooks_by_box` traces: the head's rows
    by strided slices, the scale a multiplication, the transposing reshape."""
    (out, n_in), kernel, _ = HF[module]

    def fn(m):
        if module == "self_attn.q_proj":
            m = m.reshape(H, D, E)
            m = jnp.concatenate((m[:, 0::2], m[:, 1::2]), axis=1).reshape(out, n_in)
            m = m * np.float32(1 / math.sqrt(D))
        return m.T.reshape(kernel)

    return fn


def weights(scan_axis: int | None, modules=tuple(HF), *, boxed: bool = False) -> list[A.Weight]:
    """The weights of ``modules``; ``boxed``: the hooks of `traced_hook` in float32, as the
    import runs MaxText's, on whole tensors and on boxes (`Weight.box`), the same functions
    for each layer (`Weight.hooks_id`)."""
    out = []
    for m in modules:
        shape, kernel, where = HF[m]
        names = [f"model.layers.{i}.{m}.weight" for i in range(L)]
        fn, extra = hook(m), ()
        if boxed:
            jax_fn = traced_hook(m)
            traced = PieceFn.trace(jax_fn, shape, np.dtype(np.float32), [kernel])
            assert traced is not None, m
            fn = lambda x, f=jax_fn: np.asarray(f(np.asarray(x, np.float32)))  # noqa: E731
            extra = (traced.apply, ("traced", m))
        if scan_axis is not None:
            path = ("decoder", "layers", *where.split("/"), "kernel")
            out.append(A.Weight(path, kernel, scan_axis, tuple(names), shape, fn, *extra))
            continue
        for i, n in enumerate(names):
            path = ("decoder", f"layers_{i}", *where.split("/"), "kernel")
            out.append(A.Weight(path, kernel, None, (n,), shape, fn, *extra))
    return out


def adapter(root: Path, config: dict, ranks: dict[str, int], seed: int = 0) -> Path:
    """A PEFT adapter directory: ``ranks`` maps each module (``model.layers.<i>.<m>``) to its
    rank; factors random normal, as PEFT's files hold them (float32, ``format: pt``)."""
    rng = np.random.default_rng(seed)
    d = root / "adapter"
    d.mkdir()
    (d / P.CONFIG_FILE).write_text(json.dumps(config))
    tensors = {}
    for module, r in ranks.items():
        out, n_in = BASE[module + ".weight"]
        tensors[f"{P.PREFIX}{module}.lora_A.weight"] = rng.normal(size=(r, n_in)).astype(np.float32)
        tensors[f"{P.PREFIX}{module}.lora_B.weight"] = rng.normal(size=(out, r)).astype(np.float32)
    save_file(tensors, str(d / P.WEIGHTS_FILE), metadata={"format": "pt"})
    return d


def write(d: Path, out: Path, ws: list[A.Weight], **kw) -> A.AsLoraPlan:
    """The chain `import_hf._import_as_lora` runs, MaxText's mapping given as ``ws``."""
    with HfDir.open(d, files=(P.CONFIG_FILE, P.WEIGHTS_FILE)) as ad:
        s = P.settings(ad.config, str(d / P.CONFIG_FILE))
        fs = {n: (t.shape, t.dtype) for n, t in ad.tensors.items()}
        ap = P.plan_adapter(s, fs, BASE, model_type="llama", where=str(d))
        unheld = {"lm_head.weight": "MaxText's LoRA does not adapt decoder/logits_dense"}
        lp = A.plan_as_lora(ap, ws, unheld=unheld, module_path=A.module_pattern(ws), **kw)
        arrays = A.factors(lp, ad.read)
    custom = {"lora": lp.lora_metadata(), "scan_layers": ws[0].axis is not None}
    A.write_step(arrays, out / "0", provenance={"source_layout": A.SOURCE_LAYOUT}, custom=custom)
    return lp


def restored(out: Path) -> dict[tuple[str, ...], np.ndarray]:
    # placed explicitly, as every oracle of the suite (conftest.stock_restore): a restore
    # without args places leaves where `_sharding` says, which need not be on this host
    tree = stock_restore(out / "0" / "model_params", host=True)
    flat = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        else:
            flat[path] = np.asarray(node)

    walk(tree, ())
    return flat


def peft_delta(d: Path, module: str, scale: float) -> np.ndarray:
    from safetensors.numpy import load_file

    t = load_file(str(d / P.WEIGHTS_FILE))
    a = t[f"{P.PREFIX}{module}.lora_A.weight"].astype(np.float64)
    b = t[f"{P.PREFIX}{module}.lora_B.weight"].astype(np.float64)
    return scale * b @ a


def check_step(d: Path, out: Path, ws: list[A.Weight], lp: A.AsLoraPlan, scales: dict) -> float:
    """Every layer of every weight of the restored step against the hook of PEFT's delta;
    the worst relative difference. ``scales``: module -> PEFT's scale (absent: not adapted)."""
    got = restored(out)
    assert all(k[-1] == "value" for k in got), sorted(got)
    worst = 0.0
    for w in ws:
        a = got[w.factor_path("a")]
        b = got[w.factor_path("b")]
        assert a.dtype == b.dtype == np.float32
        for i, name in enumerate(w.hf):
            la = a if w.axis is None else np.take(a, i, axis=w.axis)
            lb = b if w.axis is None else np.take(b, i, axis=w.axis)
            assert la.shape[-1] == lb.shape[0] == lp.rank
            mine = lp.scale * (la.astype(np.float64) @ lb.astype(np.float64)).reshape(w.kernel)
            module = name.removesuffix(".weight")
            if module not in scales:
                assert not mine.any(), name  # a layer PEFT leaves: zero factors
                continue
            want = w.hook(peft_delta(d, module, scales[module]))
            worst = max(worst, float(np.abs(mine - want).max() / np.abs(want).max()))
    return worst


ALL = {f"model.layers.{i}.{m}": 4 for i in range(L) for m in HF}


@pytest.mark.parametrize("scan_axis", [1, 0, None])
def test_plain_lora_restores_with_stock_orbax_as_pefts_delta(tmp_path, scan_axis):
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": list({m.split(".")[-1] for m in HF}),
    }
    d = adapter(tmp_path, cfg, ALL)
    ws = weights(scan_axis)
    lp = write(d, tmp_path / "out", ws)
    assert (lp.rank, lp.alpha) == (4, 8.0)  # PEFT's own: nothing padded, nothing folded
    assert check_step(d, tmp_path / "out", ws, lp, dict.fromkeys(ALL, 2.0)) < 1e-6
    got = restored(tmp_path / "out")
    q = ws[0].factor_path("a")
    want_a = {1: (E, L, 4), 0: (L, E, 4), None: (E, 4)}[scan_axis]
    assert got[q].shape == want_a  # qwix's layout, the layer axis on param_scan_axis
    meta = json.loads((tmp_path / "out" / "0" / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"] == {"model_params": ocp.PyTreeCheckpointHandler.typestr()}
    lora = meta["custom_metadata"]["lora"]
    assert (lora["lora_rank"], lora["lora_alpha"], lora["enable_lora"]) == (4, 8.0, True)
    assert lora["target_modules"] == sorted(w.module for w in ws)
    assert not (tmp_path / "out" / "0" / "items").exists()


@pytest.mark.parametrize("scan_axis", [1, None])
def test_probes_on_boxes_carry_the_map_the_whole_hooks_give(tmp_path, scan_axis):
    """Each probe one line of the HF tensor through the traced hooks (`Weight.box`), not the
    whole tensor: the same map, the same step; the whole hooks run only for the check, once
    a map (the layers of an unscanned module share theirs: the same functions)."""
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
           "target_modules": list({m.split(".")[-1] for m in HF})}  # fmt: skip
    d = adapter(tmp_path, cfg, ALL)
    whole, boxed = weights(scan_axis), weights(scan_axis, boxed=True)
    for b in boxed:
        want, got = A._carry(dataclasses.replace(b, box=None)), A._carry(b)
        assert not isinstance(got, str), got
        for x, y in zip(want[0].__dict__.values(), got[0].__dict__.values(), strict=True):
            np.testing.assert_array_equal(x, y)
    calls = []
    counted = [
        A.Weight(*[getattr(w, f) for f in ("path", "kernel", "axis", "hf", "hf_shape")],
                 lambda m, f=w.hook: calls.append(1) or f(m), w.box, w.hooks_id)
        for w in boxed
    ]  # fmt: skip
    lp = write(d, tmp_path / "out", counted)
    assert len(calls) == len(HF)  # one check a module: no probe ran the whole hooks
    assert check_step(d, tmp_path / "out", whole, lp, dict.fromkeys(ALL, 2.0)) < 1e-6


def test_without_hooks_id_each_unscanned_layer_is_checked(tmp_path):
    """Weights that do not say their hooks are the same functions (no `Weight.hooks_id`)
    are each checked; a layer whose hooks differ from its module's is refused."""
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}
    ranks = {f"model.layers.{i}.mlp.gate_proj": 4 for i in range(L)}
    d = adapter(tmp_path, cfg, ranks)
    calls = []
    ws = [dataclasses.replace(w, hook=lambda m, f=w.hook: calls.append(1) or f(m))
          for w in weights(None, ["mlp.gate_proj"])]  # fmt: skip
    write(d, tmp_path / "out", ws)
    assert len(calls) == 4 + L  # the four probes of the module's map, then each layer's check
    odd = ws[2]
    ws[2] = dataclasses.replace(odd, hook=lambda m, f=odd.hook: 2 * f(m))  # another scale
    with pytest.raises(A.AsLoraRefusedError) as e:
        write(d, tmp_path / "out2", ws)
    assert "decoder/layers_2/mlp/wi_0" in str(e.value) and "miss the hooked delta" in str(e.value)
    assert not (tmp_path / "out2").exists()


def test_rslora_and_patterns_padded_and_folded_exactly(tmp_path):
    """Ranks 2, 4 and 6 and four scales in one adapter: the step's rank is the largest, its
    scale the most common one; every module's product is PEFT's delta."""
    cfg = {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        "rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6},
        "alpha_pattern": {"o_proj": 3},
    }  # fmt: skip
    ranks = dict(ALL) | {f"model.layers.{i}.self_attn.q_proj": 2 for i in range(L)}
    ranks["model.layers.1.mlp.down_proj"] = 6
    d = adapter(tmp_path, cfg, ranks, seed=1)
    ws = weights(1)
    lp = write(d, tmp_path / "out", ws)
    scales = {m: (3 if "o_proj" in m else 8) / math.sqrt(r) for m, r in ranks.items()}
    assert lp.rank == 6 and lp.scale == 8 / math.sqrt(4)  # 8 of 15 tensors have 8/sqrt(4)
    assert check_step(d, tmp_path / "out", ws, lp, scales) < 1e-6
    assert sorted(lp.to_dict()["padded_ranks"]) == [2, 4]


def test_config_rank_and_alpha_are_the_steps(tmp_path):
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    ranks = {f"model.layers.{i}.self_attn.q_proj": 4 for i in range(L)}
    d = adapter(tmp_path, cfg, ranks, seed=2)
    ws = weights(1, ["self_attn.q_proj"])
    lp = write(d, tmp_path / "out", ws, rank=8, alpha=2.0)
    assert (lp.rank, lp.alpha) == (8, 2.0)
    assert check_step(d, tmp_path / "out", ws, lp, dict.fromkeys(ranks, 2.0)) < 1e-6


def test_layers_peft_leaves_get_zero_factors(tmp_path):
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["v_proj"],
        "layers_to_transform": [1],
    }
    d = adapter(tmp_path, cfg, {"model.layers.1.self_attn.v_proj": 4}, seed=3)
    for axis in (1, None):
        ws = weights(axis, ["self_attn.v_proj"])
        out = tmp_path / f"out{axis}"
        lp = write(d, out, ws)
        scales = {"model.layers.1.self_attn.v_proj": 2.0}
        assert check_step(d, out, ws, lp, scales) < 1e-6
        assert A.module_pattern(ws) in (
            "decoder/layers/self_attention/value", "decoder/layers_[0-9]+/self_attention/value"
        )  # fmt: skip


def test_the_step_is_an_adapter_step_export_reads_without_alpha(tmp_path):
    """What ``export-hf --adapter`` reads: `read_adapters` gives the recorded alpha (no
    ``--alpha`` needed), the rank from the factors; a step whose factors disagree with what
    it records is refused, naming what."""
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 5, "target_modules": ["q_proj", "gate_proj"]}
    ranks = {
        f"model.layers.{i}.{m}": 2 for i in range(L) for m in ("self_attn.q_proj", "mlp.gate_proj")
    }
    d = adapter(tmp_path, cfg, ranks, seed=4)
    ws = weights(1, ["self_attn.q_proj", "mlp.gate_proj"])
    write(d, tmp_path / "out", ws)
    step, params = adapter_item(tmp_path / "out" / "0")
    found = read_adapters(step, params)
    assert (found.alpha, found.rank, found.layer_axis) == (5.0, 2, 1)
    assert found.modules == ["decoder/layers/mlp/wi_0", "decoder/layers/self_attention/query"]
    assert _recorded(step, found) == (None, {})  # the adapter config named no base, no renames
    meta_file = step / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    meta["custom_metadata"]["lora"]["lora_rank"] = 3
    meta["custom_metadata"]["lora"]["target_modules"].append("decoder/layers/mlp/wo")
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(P.LayoutMismatchError) as e:
        _recorded(step, found)
    assert "lora_rank 3 recorded" in str(e.value) and "decoder/layers/mlp/wo: recorded" in str(
        e.value
    )


REFUSALS = {
    # name: (config change, ranks, weights given, what the error names)
    "lm_head": ({"target_modules": ["q_proj", "lm_head"]},
                {"model.layers.0.self_attn.q_proj": 4, "lm_head": 4}, None, "decoder/logits_dense"),
    "rank under the config's": ({}, {"model.layers.0.self_attn.q_proj": 4}, "rank2", "lora.lora_rank 2"),
    "module MaxText's LoRA lacks": ({"target_modules": ["q_proj", "o_proj"]},
                                    {"model.layers.0.self_attn.o_proj": 4}, "q only", "self_attn.o_proj"),
    "hook that mixes entries": ({}, {"model.layers.0.self_attn.q_proj": 4}, "mixing", "cannot be carried"),
    "traced hook that mixes entries": ({}, {"model.layers.0.self_attn.q_proj": 4}, "mixing boxed",
                                       "cannot be carried"),
    # the hooks on boxes misread (a scale the whole hooks apply, the traced ones not): the
    # probes carry a wrong map, the check against the whole hooks refuses it
    "boxes that misread the hooks": ({}, {"model.layers.0.self_attn.q_proj": 4}, "misread",
                                     "miss the hooked delta"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_naming_the_module_nothing_written(tmp_path, case):
    change, ranks, how, named = REFUSALS[case]
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **change}
    d = adapter(tmp_path, cfg, ranks)
    ws = weights(1, ["self_attn.q_proj"], boxed=how in ("mixing boxed", "misread"))
    kw = {"rank": 2} if how == "rank2" else {}
    w = ws[0]
    if how == "mixing":  # each kernel entry the sum of two HF entries: no factor map exists
        ws = [dataclasses.replace(w, hook=lambda m, f=w.hook: f(m + np.roll(m, 1, 1)))]
    if how == "mixing boxed":  # the same in JAX: a box cannot go through, the whole hooks run
        fn = traced_hook("self_attn.q_proj")
        mixed = PieceFn.trace(
            lambda m: fn(m + jnp.roll(m, 1, 1)), w.hf_shape, np.float32, [w.kernel]
        )
        whole = lambda m, f=w.hook: f(m + np.roll(m, 1, 1))  # noqa: E731
        ws = [dataclasses.replace(w, hook=whole, box=mixed.apply)]
    if how == "misread":
        fn = traced_hook("self_attn.q_proj")
        unscaled = PieceFn.trace(lambda m: fn(m) * np.float32(math.sqrt(D)), w.hf_shape,
                                 np.float32, [w.kernel])  # fmt: skip
        ws = [dataclasses.replace(w, box=unscaled.apply)]
    with pytest.raises(A.AsLoraRefusedError) as e:
        write(d, tmp_path / "out", ws, **kw)
    assert named in str(e.value), str(e.value)
    assert "Nothing was written" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_expert_adapters_are_refused(tmp_path):
    """PEFT's fused experts (``target_parameters``): qwix shares a factor across a layer's
    experts, so they are refused by name (merged mode takes them)."""
    e_, h, i, r = 3, 8, 4, 2
    base = {f"model.layers.0.mlp.experts.{x}.{n}.weight": s for x in range(e_)
            for n, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))}  # fmt: skip
    mod = f"{P.PREFIX}model.layers.0.mlp.experts"
    fs = {f"{mod}.lora_A.weight": ((r * e_, i), np.dtype(np.float32)),
          f"{mod}.lora_B.weight": ((h, r * e_), np.dtype(np.float32))}  # fmt: skip
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 4,
        "target_parameters": ["mlp.experts.down_proj"],
    }
    ap = P.plan_adapter(P.settings(cfg, "cfg"), fs, base, model_type="qwen3_moe", where="adapter")
    with pytest.raises(A.AsLoraRefusedError) as e:
        A.plan_as_lora(ap, [], unheld={})
    assert "model.layers.0.mlp.experts.down_proj: MoE experts" in str(e.value)


def test_a_step_that_exists_is_not_replaced(tmp_path):
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    d = adapter(tmp_path, cfg, {"model.layers.0.self_attn.q_proj": 4})
    ws = weights(1, ["self_attn.q_proj"])
    write(d, tmp_path / "out", ws)
    before = sorted(p.name for p in (tmp_path / "out" / "0").iterdir())
    with pytest.raises(StepExistsError):
        write(d, tmp_path / "out", ws)
    assert sorted(p.name for p in (tmp_path / "out" / "0").iterdir()) == before
