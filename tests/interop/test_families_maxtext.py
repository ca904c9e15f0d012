"""Interop: gemma3 (block scan, and with a remainder) and mixtral (MoE) on the REAL steps
MaxText 0.2.5's own trainers wrote (tests/fixtures/maxtext025, its README's gemma3 and mixtral
sections), through ``convert``, ``convert --unroll``/``--stack`` and ``export-hf``, as a user
types them (``cli.main``, in-process), judged by MaxText's own code.

The families (`FAMILIES`): gemma3 with 12 layers (six block-scanned sub-layers, scan length 2),
gemma3 with 8 layers (the six in the block scan with scan length 1, and 2 in
``decoder/layers_remainder``; only its SFT step is kept) and mixtral (2 layers, 4 experts).
Their config is the generator's model keys (`GEMMA3_MODEL_KEYS`, ...). MaxText's exporter,
``python -m maxtext.checkpoint_conversion.to_huggingface`` in Base mode, runs stock as a
subprocess (`hf_export_support.export_job`), two at a time: the exports of the fixture steps
start first and run while the conversions do; those of the converted items follow. What proves
what:

1. *convert*: each family's Tunix SFT step converted against ``--maxtext-config`` and against
   ``--target-from`` its pre-training step writes bit-identical ``items``, whose stored specs
   (`read_specs`) are the pre-training step's (the 8-layer model: MaxText's own model built from
   its config); ``verify`` checks every leaf.
2. *--unroll is MaxText's unscanned layout*: MaxText's ``to_huggingface`` of the
   ``convert --unroll --maxtext-config ... scan_layers=true`` items with ``scan_layers=false``
   writes exactly the tensors (names, shapes, dtypes, bytes) it writes for the scanned step's
   ``model_params`` with ``scan_layers=true``: each scan step of each sub-layer, and each
   remainder layer, is the Hugging Face layer MaxText's own mappings say. ``--unroll
   --target-from`` the unscanned pre-training step (no config: the block structure is read off
   the step's own scanned paths) writes the same items bit for bit, RNG state included (the
   shared stream of layer 0 in both; the other layers' copies and the remainder's dropped, as
   the report says). Its specs are the unscanned pre-training step's.
3. *--stack is MaxText's scanned layout*: the unscanned SFT step converted ``--stack`` (config,
   or ``--target-from`` the scanned pre-training step: the same items bit for bit, fresh RNG
   included, and the report lists it either way) exports (``scan_layers=true``) as MaxText
   exports the unscanned step's ``model_params`` (``scan_layers=false``). Round trip: the
   ``--unroll`` output, written back as an unscanned Tunix step and converted ``--stack``
   (``--target-from`` the step of 1.), holds the original scanned step's weights bit for bit.
4. *export-hf*: ours, of the raw Tunix step (the step itself, without and with
   ``scan_layers=true``; the unscanned one without) and of the converted, unrolled and stacked
   items, equals MaxText's ``to_huggingface`` of the step's ``model_params``, tensor by tensor.
5. *refusals*: ``export-hf`` with the other ``scan_layers`` than the step's (exit 2, naming the
   step and the ``--unroll``/``--stack`` form to export), a 12-layer config on the 8-layer step
   (exit 1, naming the remainder layers), ``convert --unroll`` of an unscanned step and
   ``--stack`` of a scanned one (exit 1, "The scan form differs", the step not moved): nothing
   is written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import json
import sys
from pathlib import Path

import families_support as F
import hf_export_support as S
import maxtext_loop_support as L
import pytest

from orbax_maxtext_layout import Target, cli, read_specs
from orbax_maxtext_layout.base.treepaths import keystr
from orbax_maxtext_layout.plan import rescan

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from conftest import raw, restore_flat  # noqa: E402  (tests/conftest.py helpers)

GEN = L.generator()
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"
P, A = ("params", "params"), ("nnx_aux", "model")


def _no_scan_key(keys: list[str]) -> list[str]:
    return [k for k in keys if not k.startswith("scan_layers=")]


@dataclasses.dataclass(frozen=True)
class Family:
    keys: list[str]  # the generator's model keys, without scan_layers
    sft: str  # the scanned Tunix SFT step
    tensors: int  # Hugging Face tensors of the model
    pretrain: str | None = None  # MaxText's scanned pre-training step, the SFT run's start
    sft_unscanned: str | None = None  # the unscanned Tunix SFT step
    pretrain_unscanned: str | None = None  # MaxText's unscanned pre-training step

    def config(self, scanned: bool) -> list[str]:
        """``--maxtext-config``'s values: base.yml, the keys, ``scan_layers``."""
        return [str(L.base_yml()), *self.keys, f"scan_layers={str(scanned).lower()}"]


FAMILIES = {
    "gemma3": Family(
        _no_scan_key(GEN.GEMMA3_MODEL_KEYS),
        "gemma3_sft_run/checkpoints/2",
        158,
        "gemma3_pretrain_run/checkpoints/0",
        "gemma3_sft_unscanned_run/checkpoints/2",
        "gemma3_pretrain_unscanned_run/checkpoints/0",
    ),
    # 8 layers: the block scan's 6 sub-layers with a scan length of 1, 2 remainder layers.
    "gemma3_remainder": Family(
        _no_scan_key(GEN.GEMMA3_REMAINDER_MODEL_KEYS),
        "gemma3_remainder_sft_run/checkpoints/2",
        106,
    ),
    "mixtral": Family(
        _no_scan_key(GEN.MIXTRAL_MODEL_KEYS),
        "mixtral_sft_run/checkpoints/2",
        41,
        "mixtral_pretrain_run/checkpoints/0",
        "mixtral_sft_unscanned_run/checkpoints/2",
        "mixtral_pretrain_unscanned_run/checkpoints/0",
    ),
}
WITH_PRETRAIN = [f for f, x in FAMILIES.items() if x.pretrain]
WITH_UNSCANNED = [f for f, x in FAMILIES.items() if x.sft_unscanned]
# Leaves of the converted items: (scanned, unscanned), each params + nnx_aux + opt_state + step.
LEAVES = {"gemma3": (255, 483), "gemma3_remainder": (333, 327), "mixtral": (54, 78)}
# Weights of the scanned model (the fixtures' README).
WEIGHTS = {"gemma3": 80, "gemma3_remainder": 106, "mixtral": 13}
# The RNG leaves --unroll drops, and why (a scanned model holds RNG its unscanned one lacks).
SHARED = "the unscanned model shares one RNG stream across its layers"
NOT_HELD = "RNG state the unscanned target does not hold"
UNROLL_DROPS = {
    "gemma3": {SHARED: 6, NOT_HELD: 6},  # layers_0's stream at scan step 1; layers_remainder
    "gemma3_remainder": {NOT_HELD: 6},  # layers_remainder/layers_0's stream (layer 6)
    "mixtral": {SHARED: 6, NOT_HELD: 6},  # MoeBlock_0's stream at layer 1; decoder/rngs
}


def run_cli(*args: object) -> tuple[int, str]:
    """``orbax-maxtext-layout ARGS`` in-process (`cli.main`): exit code and stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main([str(a) for a in args])
    return rc, buf.getvalue()


def same_leaves(got: Path, want: Path) -> list[str]:
    """Two items, restored with stock Orbax: every path in one and not the other, and every
    leaf whose dtype, shape or bytes differ (typed PRNG keys through their key data)."""
    g, w = restore_flat(got), restore_flat(want)
    out = [f"only in {got}: {keystr(p)}" for p in sorted(set(g) - set(w), key=keystr)]
    out += [f"only in {want}: {keystr(p)}" for p in sorted(set(w) - set(g), key=keystr)]
    for p in sorted(set(g) & set(w), key=keystr):
        x, y = g[p], w[p]
        if (x.dtype, x.shape) != (y.dtype, y.shape) or raw(x).tobytes() != raw(y).tobytes():
            out.append(f"{keystr(p)}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
    return out


def scan_layers_recorded(step: Path) -> bool:
    return json.loads((step / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]["scan_layers"]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families_maxtext")


@pytest.fixture(scope="module")
def fixtures(work) -> Path:
    """A writable copy of every step used, at the same relative paths."""
    root = work / "fixtures"
    for fam in FAMILIES.values():
        for rel in (fam.sft, fam.pretrain, fam.sft_unscanned, fam.pretrain_unscanned):
            if rel:
                L.copy_tree(L.FIXTURE / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def tokenizer(work) -> Path:
    return L.copy_tree(TOKENIZER, work / "tokenizer")


class MaxText:
    """MaxText's ``to_huggingface`` children (`hf_export_support.run`), two at a time, in the
    order submitted; `out` waits for one and checks its exit code."""

    def __init__(self, work: Path, tokenizer: Path) -> None:
        self.work, self.tokenizer = work, tokenizer
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, concurrent.futures.Future] = {}

    def submit(self, name: str, family: str, item: Path, *, scan_layers: bool) -> None:
        job = S.export_job(
            name,
            item,
            self.work / "maxtext" / name,
            self.tokenizer,
            scan_layers=scan_layers,
            keys=FAMILIES[family].keys,
        )
        self.futures[name] = self.pool.submit(S.run, job)

    def out(self, name: str) -> Path:
        proc = self.futures[name].result()
        assert proc.returncode == 0, proc.why()
        print(f"to_huggingface {name}: {proc.seconds:.1f} s")
        return proc.cwd / name


@pytest.fixture(scope="module")
def maxtext(work, fixtures, tokenizer):
    """MaxText's exports of the fixture steps' ``model_params``, started at once (the longest
    first): ``<family>_raw`` (scanned, ``scan_layers=true``) and ``<family>_unscanned_raw``
    (``scan_layers=false``). `runs` adds those of the converted items."""
    mt = MaxText(work, tokenizer)
    for family in ("gemma3", "gemma3_remainder", "mixtral"):
        fam = FAMILIES[family]
        if fam.sft_unscanned:
            item = fixtures / fam.sft_unscanned / "model_params"
            mt.submit(f"{family}_unscanned_raw", family, item, scan_layers=False)
        mt.submit(f"{family}_raw", family, fixtures / fam.sft / "model_params", scan_layers=True)
    yield mt
    mt.pool.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``convert`` of a copy of a step, in its own run root (Tunix 2 becomes MaxText 1,
    the legacy items kept beside ``items`` for ``verify``)."""

    root: Path
    rc: int
    report: list[dict]  # convert --json
    verify_rc: int
    verified: list[dict]  # verify --json

    @property
    def step(self) -> Path:
        return self.root / "1"

    @property
    def items(self) -> Path:
        return self.step / "items"


def _convert(work: Path, name: str, step: Path, *args: object) -> Run:
    root = work / "runs" / name / "checkpoints"
    L.copy_tree(step, root / step.name)
    rc, out = run_cli("convert", root, *args, "--json")
    report = json.loads(out) if out.strip() else []
    verify_rc, verified = run_cli("verify", root, "--json")
    return Run(root, rc, report, verify_rc, json.loads(verified) if rc == 0 else [])


def _round_trip(work: Path, family: str, unrolled: Run, scanned: Run) -> Run:
    """The ``--unroll`` output's weights and RNG state, as an unscanned Tunix step (model only,
    ``families_support.write_tunix_step``), converted ``--stack --target-from`` the scanned
    MaxText-layout step of the same model (``scanned``: its block structure is read off it;
    no config, so no model is built again)."""
    items = restore_flat(unrolled.items)
    state = {p[2:]: v for p, v in items.items() if p[:2] in (P, A)}
    step = F.write_tunix_step(work / "written" / family, 2, state)
    args = ("--stack", "--optimizer", "drop", "--target-from", scanned.step)
    return _convert(work, f"{family}/round_trip", step, *args)


@pytest.fixture(scope="module")
def runs(work, fixtures, maxtext) -> dict[tuple[str, str], Run]:
    """``(family, kind)`` -> its conversion, every one through the command line:

    - ``config`` / ``target_from``: ``convert`` of the SFT step, ``--maxtext-config`` (scanned)
      or ``--target-from`` the pre-training step;
    - ``unroll_config`` / ``unroll_target_from``: ``--unroll``, ``--maxtext-config ...
      scan_layers=true`` or ``--target-from`` the unscanned pre-training step;
    - ``stack_config`` / ``stack_target_from``: ``--stack`` of the unscanned SFT step,
      ``--maxtext-config ... scan_layers=false`` or ``--target-from`` the pre-training step;
    - ``round_trip``: `_round_trip` of ``unroll_config``, onto ``config``'s step.

    Then MaxText's exports of the unrolled (``<family>_unrolled``) and stacked
    (``<family>_stacked``) items are queued behind those of the raw steps."""
    out: dict[tuple[str, str], Run] = {}
    for family, fam in FAMILIES.items():
        sft = fixtures / fam.sft
        scanned, unscanned = fam.config(scanned=True), fam.config(scanned=False)
        kinds: dict[str, tuple[Path, list[object]]] = {
            "config": (sft, ["--maxtext-config", *scanned]),
            "unroll_config": (sft, ["--unroll", "--maxtext-config", *scanned]),
        }
        if fam.pretrain:
            kinds["target_from"] = (sft, ["--target-from", fixtures / fam.pretrain])
            unrolled = fixtures / fam.pretrain_unscanned
            kinds["unroll_target_from"] = (sft, ["--unroll", "--target-from", unrolled])
        if fam.sft_unscanned:
            src = fixtures / fam.sft_unscanned
            kinds["stack_config"] = (src, ["--stack", "--maxtext-config", *unscanned])
            kinds["stack_target_from"] = (
                src,
                ["--stack", "--target-from", fixtures / fam.pretrain],
            )
        for kind, (step, args) in kinds.items():
            out[family, kind] = _convert(work, f"{family}/{kind}", step, *args)
        unrolled, scanned_step = out[family, "unroll_config"], out[family, "config"]
        if unrolled.rc == 0 and scanned_step.rc == 0:
            out[family, "round_trip"] = _round_trip(work, family, unrolled, scanned_step)
    for family in FAMILIES:  # the longest first
        if (run := out.get((family, "unroll_config"))) and run.rc == 0:
            maxtext.submit(f"{family}_unrolled", family, run.items, scan_layers=False)
        if (run := out.get((family, "stack_config"))) and run.rc == 0:
            maxtext.submit(f"{family}_stacked", family, run.items, scan_layers=True)
    return out


def converted(runs, family: str, kind: str) -> Run:
    """A conversion that must have succeeded, every leaf verified against its source."""
    run = runs[family, kind]
    assert run.rc == 0, (family, kind, run.report)
    assert [r["status"] for r in run.report] == ["converted"], run.report
    assert run.verify_rc == 0 and len(run.verified) == 1, run.verified
    assert run.verified[0]["ok"] and run.verified[0]["problems"] == [], run.verified
    return run


@functools.cache
def maxtext_forms(family: str) -> Target:
    """The family's model as MaxText builds it from its config: scanned, the unscanned form
    its `Target.twin` (built once per family)."""
    return rescan.maxtext_forms(FAMILIES[family].config(scanned=True))


def assert_maxtext_specs(items: Path, family: str, *, scanned: bool) -> None:
    """``read_specs(items)`` is that of MaxText's own step of the model in that form (its
    pre-training step; for a model without one, the model MaxText builds from its config)."""
    fam = FAMILIES[family]
    own = fam.pretrain if scanned else fam.pretrain_unscanned
    got = read_specs(items)
    if own:
        assert got == read_specs(L.FIXTURE / own / "items")
        return
    forms = maxtext_forms(family)
    want, have = (forms if scanned else forms.twin), Target.from_specs(got)
    assert (have.params, have.nnx_aux, have.opt_state) == (
        want.params,
        want.nnx_aux,
        want.opt_state,
    )
    assert set(have.abstract) == set(want.abstract)  # step too


def export_ours(work: Path, name: str, step: Path, family: str, *extra: str) -> tuple[dict, Path]:
    """This library's ``export-hf STEP`` (``--json``): its report and ``--out``."""
    out = work / "ours" / name
    rc, report = run_cli(
        "export-hf",
        step,
        "--out",
        out,
        "--json",
        "--override-model-architecture",
        "--maxtext-config",
        str(L.base_yml()),
        *FAMILIES[family].keys,
        *extra,
    )
    assert rc == 0, report
    return json.loads(report), out


# ----------------------------------------------------------------------------- 1. convert


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_with_config_writes_maxtext_s_own_layout(family, runs):
    run = converted(runs, family, "config")
    assert run.verified[0]["checked"] == LEAVES[family][0]
    assert run.report[0]["dropped"] == []
    assert scan_layers_recorded(run.step) is True
    assert_maxtext_specs(run.items, family, scanned=True)
    if FAMILIES[family].pretrain:  # --target-from MaxText's own step: the same items
        other = converted(runs, family, "target_from")
        assert same_leaves(run.items, other.items) == []
        assert read_specs(other.items) == read_specs(run.items)


# ----------------------------------------------------------------------------- 2. --unroll


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unroll_with_config_is_maxtext_s_unscanned_layout(family, runs):
    run = converted(runs, family, "unroll_config")
    report = run.report[0]
    assert "unroll" in report["rules"]
    assert run.verified[0]["checked"] == LEAVES[family][1]
    assert scan_layers_recorded(run.step) is False
    assert_maxtext_specs(run.items, family, scanned=False)
    reasons: dict[str, int] = {}
    for d in report["dropped"]:
        assert "/rngs/" in d["path"], d  # only RNG state is dropped, never a weight
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
    assert reasons == UNROLL_DROPS[family]


@pytest.mark.parametrize("family", WITH_PRETRAIN)
def test_unroll_target_from_the_unscanned_step_writes_the_config_s_items(family, runs):
    """No config: the block structure read off the step's scanned paths, the layer count off
    MaxText's unscanned step. Every leaf is the config's, RNG state too: both keep layer 0's
    stream at ``layers_0`` (where MaxText's unscanned model holds its one stream) and drop
    the rest, with the same reasons."""
    cfg, tf = (
        converted(runs, family, "unroll_config"),
        converted(runs, family, "unroll_target_from"),
    )
    assert same_leaves(tf.items, cfg.items) == []

    def dropped(run: Run) -> list[dict]:
        return sorted(run.report[0]["dropped"], key=lambda d: d["path"])

    assert dropped(tf) == dropped(cfg)


# ----------------------------------------------------------------------------- 3. --stack


@pytest.mark.parametrize("family", WITH_UNSCANNED)
def test_stack_with_config_or_target_from_writes_maxtext_s_scanned_layout(family, runs):
    cfg, tf = converted(runs, family, "stack_config"), converted(runs, family, "stack_target_from")
    for run in (cfg, tf):
        assert "stack" in run.report[0]["rules"]
        assert run.verified[0]["checked"] == LEAVES[family][0]
        assert scan_layers_recorded(run.step) is True
        assert_maxtext_specs(run.items, family, scanned=True)
    # The same items, the RNG state the unscanned step lacks (derived from each leaf's path
    # and layer) included.
    assert same_leaves(cfg.items, tf.items) == []
    # Both reports list that RNG state: the other layers' copies of the shared stream, and
    # the scanned model's own (gemma3: layers_remainder/rngs; mixtral: decoder/rngs).
    fresh = {n for n in tf.report[0]["notes"] if "initialised fresh" in n}
    assert len(fresh) == 12, tf.report[0]["notes"]
    assert {n for n in cfg.report[0]["notes"] if "initialised fresh" in n} == fresh


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unroll_then_stack_gives_back_every_weight(family, runs, fixtures):
    run = converted(runs, family, "round_trip")
    assert scan_layers_recorded(run.step) is True
    src = restore_flat(fixtures / FAMILIES[family].sft / "model_params")
    weights = {p[:-1]: v for p, v in src.items() if "rngs" not in p}  # without /value
    got = restore_flat(run.items)
    assert {p[2:] for p in got if p[:2] == P} == set(weights)
    assert len(weights) == WEIGHTS[family]
    differ = [
        keystr(p) for p, v in weights.items() if raw(got[P + p]).tobytes() != raw(v).tobytes()
    ]
    assert differ == []


# ----------------------------------------------------------------------------- 5. refusals


@pytest.fixture
def place(tmp_path) -> Path:
    p = tmp_path / "place"
    p.mkdir()
    return p


def refused_export(capsys, place: Path, step: Path, family: str, *extra: str) -> tuple[int, str]:
    """``export-hf STEP --out <place>/hf ...`` that must write nothing: exit code, stderr."""
    capsys.readouterr()
    rc = cli.main(
        [
            "export-hf",
            str(step),
            "--out",
            str(place / "hf"),
            "--override-model-architecture",
            "--maxtext-config",
            str(L.base_yml()),
            *FAMILIES[family].keys,
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert list(place.iterdir()) == [], "a refused export wrote under or beside --out"
    return rc, err


@pytest.mark.parametrize(
    "family, which, given, form",
    [
        ("gemma3", "sft", "scan_layers=false", "--unroll"),
        ("mixtral", "sft", "scan_layers=false", "--unroll"),
        ("gemma3", "sft_unscanned", "scan_layers=true", "--stack"),
    ],
)
def test_export_hf_refuses_the_other_scan_form(capsys, place, fixtures, family, which, given, form):
    step = fixtures / getattr(FAMILIES[family], which)
    rc, err = refused_export(capsys, place, step, family, given)
    assert rc == 2, err
    stored = "scanned" if form == "--unroll" else "unscanned"
    assert f"error: {step}: the params are stored {stored}, but the config says {given}" in err
    assert "drop the key (it is read from the step)" in err
    assert f"export the {form} form of the step" in err


def test_export_hf_refuses_the_unrolled_items_with_scan_layers_true(capsys, place, runs):
    run = converted(runs, "gemma3", "unroll_config")
    rc, err = refused_export(capsys, place, run.step, "gemma3", "scan_layers=true")
    assert rc == 2, err
    assert f"{run.step}: the params are stored unscanned" in err and "--stack form" in err


def test_export_hf_refuses_a_12_layer_config_on_the_8_layer_step(capsys, place, fixtures):
    twelve = FAMILIES["gemma3"].keys
    assert "base_num_decoder_layers=12" in twelve
    step = fixtures / FAMILIES["gemma3_remainder"].sft
    rc, err = refused_export(capsys, place, step, "gemma3")
    assert rc == 1, err
    assert "model_params does not match the target model" in err
    for j in (0, 1):  # the remainder layers the 12-layer model does not have
        want = f"decoder/layers_remainder/layers_{j}/mlp/wi_0/kernel/value: not in the target model"
        assert want in err
    want = "decoder/layers/layers_0/mlp/wi_0/kernel/value: checkpoint has float32[32, 1, 64], "
    assert want + "target expects float32[32, 2, 64]" in err


@pytest.mark.parametrize(
    "which, target, flag",
    [("sft_unscanned", "pretrain", "--unroll"), ("sft", "pretrain_unscanned", "--stack")],
)
def test_convert_refuses_a_scan_change_from_the_form_the_step_is_not_in(
    capsys, tmp_path, fixtures, which, target, flag
):
    """``--target-from`` MaxText's step in the form the step already has (``--maxtext-config``
    refuses with the same message, and builds the model first)."""
    fam = FAMILIES["gemma3"]
    root = tmp_path / "checkpoints"
    step = L.copy_tree(fixtures / getattr(fam, which), root / "2")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    capsys.readouterr()
    rc = cli.main(
        ["convert", str(root), flag, "--target-from", str(fixtures / getattr(fam, target))]
    )
    out = capsys.readouterr()
    assert rc == 1, out
    assert f"{step}: failed (tunix)" in out.out
    form = "unrolled (layers_<i>)" if flag == "--unroll" else "stacked"
    assert f"The scan form differs (the checkpoint's layers are {form}" in out.out
    assert "1 step(s) failed" in out.err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # not moved, no items


# ----------------------------------------------------------------------------- 2, 3: MaxText


@pytest.mark.parametrize("family", list(FAMILIES))
def test_maxtext_exports_the_unrolled_items_as_the_scanned_step(family, runs, maxtext):
    converted(runs, family, "unroll_config")
    want = S.read_hf(maxtext.out(f"{family}_raw"))  # model_params, scan_layers=true
    got = S.read_hf(maxtext.out(f"{family}_unrolled"))  # items, scan_layers=false
    assert len(want) == FAMILIES[family].tensors
    assert {str(a.dtype) for a in want.values()} == {"float32"}
    assert S.hf_diff(got, want) == []


@pytest.mark.parametrize("family", WITH_UNSCANNED)
def test_maxtext_exports_the_stacked_items_as_the_unscanned_step(family, runs, maxtext):
    converted(runs, family, "stack_config")
    want = S.read_hf(maxtext.out(f"{family}_unscanned_raw"))  # scan_layers=false
    got = S.read_hf(maxtext.out(f"{family}_stacked"))  # scan_layers=true
    assert len(want) == FAMILIES[family].tensors
    assert S.hf_diff(got, want) == []
    # Non-vacuous: the unscanned run trained other weights than the scanned one.
    assert S.hf_diff(want, S.read_hf(maxtext.out(f"{family}_raw"))) != []


# ----------------------------------------------------------------------------- 4. export-hf


@pytest.mark.parametrize("given", [[], ["scan_layers=true"]], ids=["read", "given"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_hf_of_the_raw_step_is_to_huggingface(family, given, work, fixtures, maxtext):
    step = fixtures / FAMILIES[family].sft
    report, out = export_ours(work, f"{family}_raw_{len(given)}", step, family, *given)
    assert (report["status"], report["source"], report["scan_layers"]) == (
        "exported",
        "tunix",
        True,
    )
    got, want = S.read_hf(out), S.read_hf(maxtext.out(f"{family}_raw"))
    assert len(got) == FAMILIES[family].tensors
    assert S.hf_diff(got, want) == []


@pytest.mark.parametrize("kind", ["config", "unroll_config"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_hf_of_the_converted_items_is_to_huggingface(family, kind, work, runs, maxtext):
    run = converted(runs, family, kind)
    report, out = export_ours(work, f"{family}_{kind}", run.step, family)
    assert (report["source"], report["scan_layers"]) == ("maxtext", kind == "config")
    got, want = S.read_hf(out), S.read_hf(maxtext.out(f"{family}_raw"))
    assert S.hf_diff(got, want) == []


@pytest.mark.parametrize("source", ["step", "stacked"])
@pytest.mark.parametrize("family", WITH_UNSCANNED)
def test_export_hf_of_the_unscanned_step_and_its_stack_is_to_huggingface(
    family, source, work, fixtures, runs, maxtext
):
    if source == "stacked":
        step = converted(runs, family, "stack_config").step
    else:
        step = fixtures / FAMILIES[family].sft_unscanned
    report, out = export_ours(work, f"{family}_unscanned_{source}", step, family)
    assert report["scan_layers"] is (source == "stacked")
    got, want = S.read_hf(out), S.read_hf(maxtext.out(f"{family}_unscanned_raw"))
    assert S.hf_diff(got, want) == []
