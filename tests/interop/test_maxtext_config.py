"""Interop: the target MaxText 0.2.5 builds from its own config (``--maxtext-config``,
``Target.from_maxtext_config``) is the target of MaxText's own checkpoint.

The model is the tiny one of tests/fixtures/maxtext025 (the fixture generator's own
``MODEL_KEYS``, scanned, and ``UNSCANNED_MODEL_KEYS``), whose pre-training runs MaxText's own
``train.py`` wrote: ``pretrain_run`` (scanned) and ``pretrain_unscanned_run``. What proves what:

- *the same target*: built from the config, in this process, it has exactly the leaves and
  stored specs (shape, dtype, PRNG key implementation) of ``--target-from`` MaxText's own
  checkpoint of that config, in both scan forms, and the same items paths (``step`` too);
  building it leaves the working directory empty and JAX's default PRNG as it was;
- *the same conversion*: converting MaxText's own SFT step and RL actor step with it writes
  ``items`` bit-identical to converting them with ``--target-from`` (the API, and the command
  line as users run it);
- *a wrong size*: a config of another size refuses both steps (exit 1), naming each mismatched
  leaf with both shapes, and writes nothing;
- ``inspect`` and ``merge-lora`` take it as they take ``--target-from``.

The command-line runs are subprocesses of the installed console script (each imports MaxText,
several seconds); the in-process target is built once per scan form.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import maxtext_loop_support as L
import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout import Target
from orbax_maxtext_layout.base.treepaths import keystr

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from conftest import raw, restore_flat, tree_digest  # noqa: E402  (tests/conftest.py helpers)

GEN = L.generator()
KEYS = {"scanned": list(GEN.MODEL_KEYS), "unscanned": list(GEN.UNSCANNED_MODEL_KEYS)}
# MaxText's own checkpoints of each config (what --target-from is given).
OWN = {
    "scanned": [L.FIXTURE / "pretrain_run" / "checkpoints" / n for n in ("0", "1")],
    "unscanned": [L.FIXTURE / "pretrain_unscanned_run" / "checkpoints" / "0"],
}
# Tunix steps of the scanned model, where a conversion puts them (relative to a run root).
STEPS = {"sft": (L.SFT_STEP, "2"), "rl": (L.RL_STEP, "actor/2")}
WRONG_SIZE = {"base_emb_dim=16": "base_emb_dim=32"}
MERGE_ALPHA = "8"


def config_args(form: str, *, wrong_size: bool = False) -> list[str]:
    keys = [WRONG_SIZE.get(k, k) if wrong_size else k for k in KEYS[form]]
    return [str(L.base_yml()), *keys]


def cli(*args: str, cwd: Path, rc: int | None = 0) -> subprocess.CompletedProcess:
    """``orbax-maxtext-layout ARGS`` in ``cwd``: the console script next to this interpreter."""
    script = shutil.which("orbax-maxtext-layout", path=str(Path(sys.executable).parent))
    assert script, f"no orbax-maxtext-layout script next to {sys.executable}"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the CLI picks CPU
    proc = subprocess.run(
        [script, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )
    if rc is not None:
        assert proc.returncode == rc, (
            f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def run_root(base: Path) -> Path:
    """A run root holding a writable copy of the SFT step (``2``) and the RL step (``actor/2``)."""
    root = base / "checkpoints"
    for src, rel in STEPS.values():
        L.copy_tree(src, root / rel)
    return root


def assert_same_items(got: Path, want: Path) -> None:
    """Two converted steps hold bit-identical ``items``: the same Orbax metadata files, every
    leaf with the same dtype (typed PRNG keys stay typed), shape and bytes, and the same
    provenance but for the source's path, the bytes written (OCDBT's files have random
    names: the new root database's size varies by a few bytes) and how the data files were
    placed (shared or copied: a property of the file systems, not of the conversion)."""
    for name in ("_METADATA", "_sharding", "array_metadatas/process_0"):
        assert (got / "items" / name).read_bytes() == (want / "items" / name).read_bytes(), name
    g, w = restore_flat(got / "items"), restore_flat(want / "items")
    assert set(g) == set(w) and len(g) == 51
    bad = [
        keystr(p)
        for p in w
        if g[p].dtype != w[p].dtype
        or g[p].shape != w[p].shape
        or raw(g[p]).tobytes() != raw(w[p]).tobytes()
    ]
    assert not bad, bad

    def provenance(step: Path) -> dict:
        prov = dict(oml.converted_provenance(step))
        skip = ("source", "bytes_written", "data_files")
        return {k: v for k, v in prov.items() if k not in skip}

    assert provenance(got) == provenance(want)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[oml.Target, float]]:
    """Each form's target, built once in this process (the first build imports MaxText), in an
    empty working directory: ``{form: (target, seconds)}``."""
    cwd = tmp_path_factory.mktemp("cwd")
    prng = jax.config.jax_default_prng_impl
    here = os.getcwd()
    os.chdir(cwd)
    try:
        out = {}
        for form in KEYS:
            start = time.monotonic()
            out[form] = (Target.from_maxtext_config(config_args(form)), time.monotonic() - start)
    finally:
        os.chdir(here)
    assert list(cwd.iterdir()) == [], "building the target wrote into the working directory"
    assert jax.config.jax_default_prng_impl == prng
    return out


# ----------------------------------------------------------------------------- the target


@pytest.mark.parametrize("form", list(KEYS))
def test_the_target_is_that_of_maxtexts_own_checkpoint(form, built):
    target, seconds = built[form]
    print(f"{form}: target built in {seconds:.1f} s")
    for own in OWN[form]:
        want = oml.Target.from_checkpoint(own)
        assert target.params == want.params
        assert target.nnx_aux == want.nnx_aux
        assert target.opt_state == want.opt_state
        assert set(target.abstract) == set(want.abstract)  # step too
    scanned = form == "scanned"
    assert len(target.params) == (12 if scanned else 30)
    assert len(target.nnx_aux) == (12 if scanned else 6)
    keys = [s for p, s in target.nnx_aux.items() if p[-1] == "key"]  # as train.py sets the PRNG
    assert len(keys) == (6 if scanned else 3) and {s.key_impl for s in keys} == {"unsafe_rbg"}


@pytest.mark.parametrize("kind", list(STEPS))
def test_converting_with_it_writes_what_target_from_writes(kind, built, tmp_path):
    src, _ = STEPS[kind]
    targets = {
        "config": built["scanned"][0],
        "checkpoint": oml.Target.from_checkpoint(OWN["scanned"][-1]),
    }
    out = {}
    for name, target in targets.items():
        step = L.copy_tree(src, tmp_path / name / "src")
        report = oml.convert_step(step, target, out=tmp_path / name / "out")
        assert report.status == "converted", report
        out[name] = tmp_path / name / "out"
    assert_same_items(out["config"], out["checkpoint"])


def test_a_config_that_maxtext_rejects_is_a_usage_error(tmp_path):
    with pytest.raises(oml.UsageError, match="no_such_key"):
        Target.from_maxtext_config([*config_args("scanned"), "no_such_key=1"])
    with pytest.raises(oml.UsageError, match=r"lora\.enable_lora"):
        Target.from_maxtext_config([*config_args("scanned"), "lora.enable_lora=true"])


# ----------------------------------------------------------------------------- the command line


def test_convert_with_maxtext_config_writes_what_target_from_writes(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    roots = {name: run_root(tmp_path / name) for name in ("config", "checkpoint")}
    got = cli(
        "convert",
        str(roots["config"]),
        "--maxtext-config",
        *config_args("scanned"),
        "--json",
        cwd=cwd,
    )
    want = cli(
        "convert",
        str(roots["checkpoint"]),
        "--target-from",
        str(OWN["scanned"][-1]),
        "--json",
        cwd=cwd,
    )
    reports = {n: json.loads(p.stdout) for n, p in (("config", got), ("checkpoint", want))}
    assert [r["status"] for r in reports["config"]] == ["converted", "converted"]
    assert list(cwd.iterdir()) == []
    for _, rel in STEPS.values():  # Tunix 2 is MaxText 1
        rel = str(Path(rel).parent / "1")
        assert_same_items(roots["config"] / rel, roots["checkpoint"] / rel)


def test_a_config_of_another_size_names_every_mismatch_and_writes_nothing(built, tmp_path):
    root = run_root(tmp_path)
    before = tree_digest(root)
    wrong = Target.from_maxtext_config(config_args("scanned", wrong_size=True))
    right = built["scanned"][0]
    differ = [p for p in right.params if right.params[p] != wrong.params[p]]
    assert len(differ) == 12  # every weight has the embedding dimension
    # ROOT after the option's values: it is a positional argument all the same.
    res = cli(
        "convert",
        "--maxtext-config",
        *config_args("scanned", wrong_size=True),
        str(root),
        cwd=tmp_path,
        rc=1,
    )
    for _, rel in STEPS.values():
        assert f"{root / rel}: failed" in res.stdout
    out = res.stdout
    # The error names the target: the config's model_name (issue 41).
    model = next(a.split("=", 1)[1] for a in config_args("scanned") if a.startswith("model_name="))
    wanted = f"does not match the target model (MaxText's {model}) (12 offending paths)"
    assert out.count(wanted) == 2, out
    for p in differ:  # the SFT step's paths; the RL step's have the adapter's "base/" in front
        line = f"{keystr(p)}/value: checkpoint has {right.params[p]}, target expects "
        assert f"- {line}{wrong.params[p]}" in out, (line, out)
        assert f"- base/{line}{wrong.params[p]}" in out, (line, out)
    assert "2 step(s) failed" in res.stderr
    assert tree_digest(root) == before and list(tmp_path.iterdir()) == [root]
    assert sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir() and p.name.isdigit()
    ) == ["2", "actor/2"]


def test_inspect_with_maxtext_config_shows_what_target_from_shows(tmp_path):
    """The unscanned config against the scanned steps: the same plan and the same mismatches."""
    root = run_root(tmp_path)
    got = cli(
        "inspect", str(root), "--maxtext-config", *config_args("unscanned"), "--json", cwd=tmp_path
    )
    want = cli(
        "inspect", str(root), "--target-from", str(OWN["unscanned"][0]), "--json", cwd=tmp_path
    )
    got, want = json.loads(got.stdout), json.loads(want.stdout)
    # The same but for the target each names (issue 41): the config's model, the directory.
    model = next(a.split("=", 1)[1] for a in config_args("unscanned") if "model_name=" in a)
    named = f"(MaxText's {model})", f"(--target-from {OWN['unscanned'][0]})"
    assert all(named[0] in e["mismatch"][0] for e in got), got[0]["mismatch"][0]
    assert all(named[1] in e["mismatch"][0] for e in want), want[0]["mismatch"][0]
    for e in got:
        e["mismatch"] = [m.replace(*named) for m in e["mismatch"]]
    assert got == want
    assert all(e["mismatch"] for e in got)  # a scanned step does not fit the unscanned model


def test_merge_lora_onto_a_tunix_base_with_maxtext_config(tmp_path):
    """A full Tunix base needs a target; the one from the config merges what --target-from
    merges (every base weight, the adapters of MaxText's own LoRA run applied)."""
    lora = L.FIXTURE / "lora_run" / "checkpoints" / "2"
    out = {}
    for name, target in (
        ("config", ["--maxtext-config", *config_args("scanned")]),
        ("checkpoint", ["--target-from", str(OWN["scanned"][-1])]),
    ):
        out[name] = tmp_path / name
        cli(
            "merge-lora",
            str(lora),
            "--base",
            str(L.SFT_STEP),
            "--alpha",
            MERGE_ALPHA,
            "--out",
            str(out[name]),
            *target,
            cwd=tmp_path,
        )
    g, w = (
        restore_flat(out["config"] / "0" / "items"),
        restore_flat(out["checkpoint"] / "0" / "items"),
    )
    assert set(g) == set(w) and len(g) == 12
    assert all(raw(g[p]).tobytes() == raw(w[p]).tobytes() for p in w)
