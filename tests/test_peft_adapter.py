"""A PEFT adapter judged and planned against a base (issue 60): `lora.peft_adapter`, and its
directory read as untrusted input (`HfDir.open(..., files=...)`).

The exactness against PEFT itself (adapters made by PEFT, merged by ``merge_and_unload``) is
tests/interop/test_import_adapter.py's; here, without torch, PEFT's rules as written in its
0.21.2 source: the scale per module (``alpha/r``, rsLoRA ``alpha/sqrt(r)``, the first
``rank_pattern``/``alpha_pattern`` key in the file's order that ``re.match(rf"(.*\\.)?(key)$")``
accepts), a fused experts pair's expert slices (``ParamWrapper.get_delta_weight``'s einsum),
and what is refused. Then a fuzz of configs, factor sets and adapter files: each is planned or
refused with a named error, never another exception, and a refused directory holds no file
open.
"""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from orbax_maxtext_layout.errors import LayoutMismatchError
from orbax_maxtext_layout.formats.safetensors_reader import HfDir, HfInputError
from orbax_maxtext_layout.lora import peft_adapter as P

F32 = np.dtype(np.float32)
FILES = (P.CONFIG_FILE, P.WEIGHTS_FILE)
# a llama-like base: 2 layers, emb 16, q/o 16x16, k/v 8x16, mlp 32
BASE = {
    f"model.layers.{i}.{m}.weight": s
    for i in range(2)
    for m, s in {
        "self_attn.q_proj": (16, 16), "self_attn.k_proj": (8, 16), "self_attn.v_proj": (8, 16),
        "self_attn.o_proj": (16, 16), "mlp.gate_proj": (32, 16), "mlp.up_proj": (32, 16),
        "mlp.down_proj": (16, 32),
    }.items()
} | {"lm_head.weight": (64, 16), "model.embed_tokens.weight": (64, 16)}  # fmt: skip
GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def factors(rank: dict[str, int], base=BASE) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The factor shapes PEFT saves for modules ``rank`` (module -> its rank)."""
    out = {}
    for module, r in rank.items():
        o, i = base[module + ".weight"]
        out[f"{P.PREFIX}{module}.lora_A.weight"] = ((r, i), F32)
        out[f"{P.PREFIX}{module}.lora_B.weight"] = ((o, r), F32)
    return out


def plan(config: dict, fs: dict, base=BASE, model_type: str = "llama") -> P.AdapterPlan:
    return P.plan_adapter(
        P.settings(config, "cfg"), fs, base, model_type=model_type, where="adapter"
    )


def test_scale_per_module_as_peft():
    cfg = dict(GOOD, target_modules="all-linear", lora_alpha=8)
    cfg["rank_pattern"] = {"q_proj": 2, r"layers\.1\.self_attn\.q_proj": 6}  # the first wins
    cfg["alpha_pattern"] = {"layers.1.mlp.down_proj": 3, "down_proj": 5}
    ranks = {m[: -len(".weight")]: 4 for m in BASE if "layers" in m}
    ranks |= {"model.layers.0.self_attn.q_proj": 2, "model.layers.1.self_attn.q_proj": 2}
    p = plan(cfg, factors(ranks))
    d = p.deltas
    assert d["model.layers.1.self_attn.q_proj.weight"].scale == 8 / 2
    assert d["model.layers.1.mlp.down_proj.weight"].scale == 3 / 4
    assert d["model.layers.0.mlp.down_proj.weight"].scale == 5 / 4  # "down_proj" at a dot
    assert d["model.layers.0.mlp.up_proj.weight"].scale == 8 / 4
    rs = plan(dict(GOOD, use_rslora=True), factors({"model.layers.0.self_attn.q_proj": 4}))
    assert rs.deltas["model.layers.0.self_attn.q_proj.weight"].scale == 8 / math.sqrt(4)
    # a pattern matches at a dot only: "proj" is no module name's end after a dot
    odd = plan(
        dict(GOOD, rank_pattern={"proj": 9}), factors({"model.layers.0.self_attn.q_proj": 4})
    )
    assert odd.deltas["model.layers.0.self_attn.q_proj.weight"].rank == 4


def test_merge_is_w_plus_scaled_b_at_a_in_float32():
    rng = np.random.default_rng(0)
    a, b, w = rng.normal(size=(4, 16)), rng.normal(size=(8, 4)), rng.normal(size=(8, 16))
    read = {f"{P.PREFIX}model.layers.0.self_attn.v_proj.lora_A.weight": a.astype(np.float16),
            f"{P.PREFIX}model.layers.0.self_attn.v_proj.lora_B.weight": b.astype(np.float32)}  # fmt: skip
    p = plan(GOOD, {k: (v.shape, v.dtype) for k, v in read.items()})
    got = p.merge("model.layers.0.self_attn.v_proj.weight", w.astype(np.float32), read.__getitem__)
    want = w + 2.0 * b @ a.astype(np.float16).astype(np.float64)
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-5
    untouched = w.astype(np.float32)
    assert p.merge("model.layers.0.mlp.up_proj.weight", untouched, read.__getitem__) is untouched


def test_merge_by_blocks_rounds_each_float32_sum_once_into_the_save_dtype():
    """A tensor of several blocks (`P.MERGE_BLOCK`): the float32 sums are the whole
    product's, and a bfloat16 merge is each of them rounded once (to nearest even), written
    into the source's own buffer where asked and the dtypes agree, never into another."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rows, cols = 300, 2048  # 256 rows a block: a whole block and an edge
    assert P.MERGE_BLOCK // (4 * cols) < rows
    base = {"model.layers.0.self_attn.q_proj.weight": (rows, cols)}
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, cols)).astype(np.float32)
    b = rng.normal(size=(rows, 4)).astype(np.float32)
    read = {f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": a,
            f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": b}  # fmt: skip
    p = plan(GOOD, {k: (v.shape, v.dtype) for k, v in read.items()}, base=base)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = rng.normal(size=(rows, cols)).astype(bf16)
    whole = np.matmul(b, a)
    whole *= np.float32(2.0)
    whole += w
    sums = p.merge(name, w, read.__getitem__)  # float32, a new array
    assert sums.dtype == np.float32 and sums is not w
    assert np.abs(sums - whole).max() <= 1e-6 * np.abs(whole).max()
    kept = w.copy()
    got = p.merge(name, w, read.__getitem__, dtype=bf16, in_place=True)
    assert got is w  # into the bytes read
    assert got.tobytes() == sums.astype(bf16).tobytes()
    again = p.merge(name, kept, read.__getitem__, dtype=np.float32, in_place=True)
    assert again is not kept and again.tobytes() == sums.tobytes()  # bf16 source: a new array
    assert p.held(name, 4 * rows * cols) == P.MERGE_BLOCK  # a block, not the tensor


def test_the_compiled_bf16_sum_is_numpys_bit_for_bit(monkeypatch):
    """`storage.transpose.add_scaled_bf16` (a merge's scale, sum and bfloat16 cast in one
    compiled pass) against NumPy's three passes, every bit: random values and bit patterns,
    NaNs of both signs and any payload, infinities, sums that overflow, ties, subnormals and
    signed zeros; lengths that leave a tail past its 8-item blocks; written into ``w`` itself;
    and a whole merge with and without it."""
    import ml_dtypes

    from orbax_maxtext_layout.storage import transpose

    if getattr(transpose.native(), "add_scaled_bf16", None) is None:
        pytest.skip("the compiled loops were not built here (python setup.py build_ext --inplace)")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    special = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-45, 1.0 + 2**-8,
         1.0 + 3 * 2**-8, 65504.0, 2**-126], np.float32)  # fmt: skip
    payloads = np.array([0x7F800001, 0xFF812345, 0x7FFFFFFF], np.uint32).view(np.float32)
    for n in (1, 7, 8, 9, 64, 1003):
        d = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
        d[: min(n, len(special))] = special[: min(n, len(special))]
        d[-min(n, 3) :] = payloads[: min(n, 3)]
        w = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(bf16)  # every pattern, NaNs too
        for scale in (2.0, 8 / math.sqrt(16), 1e-3, 3.0e38):
            want = d.copy()
            with np.errstate(over="ignore", invalid="ignore"):
                want *= np.float32(scale)
                want += w
                want = want.astype(bf16)
            out = np.empty(n, bf16)
            assert transpose.add_scaled_bf16(out, d, w, scale)
            assert out.view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), (n, scale)
            mine = w.copy()
            assert transpose.add_scaled_bf16(mine, d, mine, scale)  # into w itself
            assert mine.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert not transpose.add_scaled_bf16(np.empty(4, np.float32), d[:4], w[:4], 1.0)
    assert not transpose.add_scaled_bf16(np.empty(8, bf16)[::2], d[:4], w[:4], 1.0)
    # a whole merge, compiled and NumPy's
    rows, cols = 70, 4099
    base = {"model.layers.0.self_attn.q_proj.weight": (rows, cols)}
    read = {f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight":
            rng.normal(size=(4, cols)).astype(np.float32),
            f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight":
            rng.normal(size=(rows, 4)).astype(np.float32)}  # fmt: skip
    p = plan(GOOD, {k: (v.shape, v.dtype) for k, v in read.items()}, base=base)
    w = rng.normal(size=(rows, cols)).astype(bf16)
    name = "model.layers.0.self_attn.q_proj.weight"
    compiled = p.merge(name, w, read.__getitem__, dtype=bf16)
    monkeypatch.setattr(transpose, "_native", None)
    by_numpy = p.merge(name, w, read.__getitem__, dtype=bf16)
    assert compiled.view(np.uint16).tobytes() == by_numpy.view(np.uint16).tobytes()


def experts_base(e: int = 3, h: int = 8, i: int = 4) -> dict:
    return {
        f"model.layers.0.mlp.experts.{x}.{n}.weight": s
        for x in range(e)
        for n, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))
    }


def test_fused_experts_are_sliced_as_peft_param_wrapper():
    """``delta[e] = einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r,
    in))`` (PEFT 0.21.2, experts stored (E, out, in)), gate_up split at I rows; of two targeted
    parameters the later one (down_proj) is the outer wrapper, saved without ``base_layer``."""
    rng = np.random.default_rng(1)
    e, h, i, r = 3, 8, 4, 2
    mod = f"{P.PREFIX}model.layers.0.mlp.experts"
    t = {
        f"{mod}.base_layer.lora_A.weight": rng.normal(size=(r * e, h)).astype(np.float32),
        f"{mod}.base_layer.lora_B.weight": rng.normal(size=(2 * i, r * e)).astype(np.float32),
        f"{mod}.lora_A.weight": rng.normal(size=(r * e, i)).astype(np.float32),
        f"{mod}.lora_B.weight": rng.normal(size=(h, r * e)).astype(np.float32),
    }
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": None,
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}  # fmt: skip
    p = plan(cfg, {k: (v.shape, v.dtype) for k, v in t.items()}, experts_base(e, h, i), "qwen3_moe")
    assert len(p.deltas) == 3 * e
    for side, (a, b) in {
        "gate_up": (t[f"{mod}.base_layer.lora_A.weight"], t[f"{mod}.base_layer.lora_B.weight"]),
        "down": (t[f"{mod}.lora_A.weight"], t[f"{mod}.lora_B.weight"]),
    }.items():
        full = np.einsum("ore,eri->eoi", b.reshape(b.shape[0], r, e), a.reshape(e, r, -1)) * 2.0
        for x in range(e):
            names = ["gate_proj", "up_proj"] if side == "gate_up" else ["down_proj"]
            for k, n in enumerate(names):
                name = f"model.layers.0.mlp.experts.{x}.{n}.weight"
                got = p.deltas[name].compute(t.__getitem__)
                rows = full[x][k * i : (k + 1) * i] if side == "gate_up" else full[x]
                assert np.abs(got - rows).max() < 1e-5, name


REFUSED = {
    "dora": ({"use_dora": True}, "use_dora"),
    "ia3": ({"peft_type": "IA3"}, "peft_type"),
    "pissa": ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
    "bias": ({"bias": "all"}, "bias"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "unknown": ({"new_variant_config": {"k": 1}}, "new_variant_config"),
    "rank type": ({"r": "4"}, "r '4'"),
    "alpha nan": ({"lora_alpha": float("nan")}, "lora_alpha"),
    "bad regex": ({"rank_pattern": {"(": 2}}, "rank_pattern"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_refused_by_name(case):
    change, named = REFUSED[case]
    with pytest.raises(P.AdapterRefusedError) as e:
        P.settings(dict(GOOD, **change), "cfg")
    assert named in str(e.value) and isinstance(e.value, LayoutMismatchError)


def test_factors_refused_by_name():
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    claims = factors({q: 2})  # the config says r 4
    shapes = factors({q: 4}) | {f"{P.PREFIX}{q}.lora_B.weight": ((8, 4), F32)}  # k's size
    cases = {
        "rank 4 over": claims,
        "lora_B [8, 4]; rank 4": shapes,
        "does not target": factors({k: 4}),
        "lora_A without lora_B": {f"{P.PREFIX}{q}.lora_A.weight": ((4, 16), F32)},
        "no tensor": {f"{P.PREFIX}model.layers.0.self_attn.x_proj.lora_A.weight": ((4, 16), F32),
                      f"{P.PREFIX}model.layers.0.self_attn.x_proj.lora_B.weight": ((16, 4), F32)},
        "not a LoRA factor": factors({q: 4}) | {f"{P.PREFIX}{q}.lora_magnitude_vector": ((16,), F32)},
        "not a float": {n: (s, np.dtype(np.int32)) for n, (s, _) in factors({q: 4}).items()},
        "no LoRA factors": {},
    }  # fmt: skip
    for named, fs in cases.items():
        cfg = dict(GOOD, target_modules=["q_proj", "x_proj"])
        with pytest.raises(P.AdapterRefusedError) as e:
            plan(cfg, fs)
        assert named in str(e.value), (named, str(e.value))


def test_a_targeted_module_without_factors_is_refused_only_where_peft_would_randomise_it():
    """PEFT loads an adapter whose file lacks a targeted module's factors with that module's
    init: zero change for B at zero, a random one with ``init_lora_weights`` false."""
    q = "model.layers.0.self_attn.q_proj"
    fs = factors({q: 4})
    assert plan(GOOD, fs).modules == [q]  # v_proj targeted, absent: B would start at zero
    with pytest.raises(P.AdapterRefusedError) as e:
        plan(dict(GOOD, init_lora_weights=False), fs)
    assert "model.layers.1.self_attn.v_proj: targeted" in str(e.value)
    assert f"{q}:" not in str(e.value)


def _mutations(rng: random.Random) -> dict:
    junk = [None, True, 0, -1, 2**70, 1.5, float("inf"), "", "x" * 5000, "(", [], [1, "a"], {},
            {"a": None}, {"(": 1}, [[[]]], "all-linear", ".*", ["q_proj"], {"q_proj": 0}]  # fmt: skip
    cfg = dict(GOOD)
    keys = [*P.READ, *P.REFUSED, "unknown_key"]
    for _ in range(rng.randint(1, 4)):
        cfg[rng.choice(keys)] = rng.choice(junk)
    return cfg


def test_fuzz_configs_and_factors_are_planned_or_refused_by_name():
    rng = random.Random(60)
    modules = [m[: -len(".weight")] for m in BASE]
    for _ in range(400):
        cfg = _mutations(rng)
        fs = factors({m: rng.choice([1, 4, 8]) for m in rng.sample(modules, rng.randint(0, 4))})
        for name in rng.sample(sorted(fs), min(len(fs), rng.randint(0, 2))):
            shape, _ = fs[name]
            fs[name] = (tuple(rng.choice([0, 1, 4, 16, 2**40]) for _ in shape), F32)
        try:
            plan(cfg, fs, model_type=rng.choice(["llama", "mixtral", "qwen3_moe"]))
        except P.AdapterRefusedError as e:
            assert e.problems and all("\n" not in p for p in e.problems)


# ----------------------------------------------------------------------------- the directory


def adapter_dir(root: Path, config: object = GOOD, tensors: dict | None = None) -> Path:
    d = root / "adapter"
    d.mkdir()
    (d / P.CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is None:
        tensors = {
            f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 16), F32),
            f"{P.PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": np.ones((16, 4), F32),
        }
    save_file(tensors, str(d / P.WEIGHTS_FILE), metadata={"format": "pt"})
    return d


def test_an_adapter_directory_opens_with_hf_dirs_checks(tmp_path):
    d = adapter_dir(tmp_path)
    with HfDir.open(d, files=FILES) as ad:
        assert ad.config == GOOD and len(ad.tensors) == 2
        p = plan(ad.config, {n: (t.shape, t.dtype) for n, t in ad.tensors.items()})
        merged = p.merge("model.layers.0.self_attn.q_proj.weight", np.zeros((16, 16), F32), ad.read)
        assert np.all(merged == 8.0)  # 2 · (B @ A) of ones, rank 4


def _cut(d: Path) -> None:
    f = d / P.WEIGHTS_FILE
    f.write_bytes(f.read_bytes()[:-7])


def _header(d: Path) -> None:
    f = d / P.WEIGHTS_FILE
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    f.write_bytes(data[:8] + data[8 : 8 + n].replace(b'"F32"', b'"Q99"') + data[8 + n :])


def _link_out(d: Path) -> None:
    (d / P.WEIGHTS_FILE).rename(d.parent / "elsewhere.safetensors")
    (d / P.WEIGHTS_FILE).symlink_to(d.parent / "elsewhere.safetensors")


DIR_REFUSALS = {
    "cut short": (_cut, "data"),
    "unknown dtype": (_header, "Q99"),
    "link out": (_link_out, "outside"),
    "no weights": (lambda d: (d / P.WEIGHTS_FILE).unlink(), "no adapter_model.safetensors"),
    "config twice": (
        lambda d: (d / P.CONFIG_FILE).write_text('{"peft_type": "LORA", "use_dora": false, "use_dora": true}'),
        "use_dora",
    ),
    "config not json": (lambda d: (d / P.CONFIG_FILE).write_text("{"), "config"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DIR_REFUSALS))
def test_a_hostile_adapter_directory_is_refused_by_name(tmp_path, case):
    change, named = DIR_REFUSALS[case]
    d = adapter_dir(tmp_path)
    change(d)
    with pytest.raises(HfInputError) as e:
        HfDir.open(d, files=FILES).close()
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_fuzz_adapter_files(tmp_path):
    """Bytes of the file flipped at random: each opens or is an `HfInputError`."""
    rng = random.Random(6)
    d = adapter_dir(tmp_path)
    good = (d / P.WEIGHTS_FILE).read_bytes()
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(0, min(len(data), 200))] = rng.randrange(256)
        (d / P.WEIGHTS_FILE).write_bytes(bytes(data))
        try:
            HfDir.open(d, files=FILES).close()
        except HfInputError as e:
            assert "\n" not in str(e)
