"""Interop (issue 46): ``export-hf`` of a step whose OCDBT data-file table points outside the
item is refused before anything outside is read, and writes nothing.

Here, not in the core suite: export-hf plans from MaxText's own model (``--maxtext-config``)
before it opens any item, so without MaxText it stops earlier, at "install maxtext"
(tests/test_export_hf_cli.py), and never reaches the table. The forged items and the strace
check are the core suite's (tests/hostile_support.py, tests/ocdbt_craft.py; the cases are
described there and in tests/test_hostile_paths.py). The export runs as users type it,
``python -m orbax_maxtext_layout export-hf``, offline, in a child forked from the suite's
MaxText fork server (`hf_export_support.run_cli`: MaxText is not imported again for each
case), under strace where there is one: strace attaches to the child before it starts the
command, so every file the export touches is in its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import hostile_support as H  # noqa: E402  (tests/hostile_support.py)

LEAVES = "leaves the checkpoint"
SFT = "sft_run/checkpoints/2"  # a Tunix step: export-hf reads model_params
PRETRAIN = "pretrain_run/checkpoints/1"  # MaxText's: items; the LoRA run's base
LORA = "lora_run/checkpoints/2"
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"


def _export(tmp_path: Path, *args: object, bait: list[Path]) -> subprocess.CompletedProcess:
    argv = ["export-hf", *map(str, args)]
    argv += ["--hf-model-path", str(TOKENIZER), "--override-model-architecture"]
    argv += ["--maxtext-config", str(L.base_yml()), *S.model_keys()]
    if not H.STRACE:
        return S.run_cli(*argv, cwd=L.REPO)
    log = tmp_path / "strace.log"
    res = S.run_cli(*argv, cwd=L.REPO, trace=H.strace_argv(log))
    hits = H.touched(log, bait, cwd=L.REPO)
    assert hits == [], "\n".join(hits[:20])
    return res


def _forged(world: Path, fixture: str, item: str, case: str) -> tuple[Path, H.Forged]:
    step = L.copy_tree(L.FIXTURE / fixture, world / "run" / fixture)
    victim = None
    if case == "victim":
        victim = L.copy_tree(step, world / "victim" / fixture) / item
    return step, H.forge(step / item, case, world, victim=victim)


def _assert_refused(res: subprocess.CompletedProcess, f: H.Forged) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Traceback" not in out, out
    lines = [x for x in res.stderr.splitlines() if LEAVES in x]
    assert any(str(f.item) in x and H.names_offender(x, f) for x in lines), out


@pytest.mark.parametrize("case", H.CASES)
def test_export_of_a_forged_step_is_refused(tmp_path, case):
    world = (tmp_path / "world").resolve()
    step, f = _forged(world, SFT, "model_params", case)
    out = world / "hf"
    before = H.snapshot(world)
    res = _export(tmp_path, step, "--out", out, bait=f.bait)
    _assert_refused(res, f)
    assert H.snapshot(world) == before  # no hf/, no hf.export-hf-tmp, nothing changed


@pytest.mark.parametrize("case", ["outside", "absolute_base", "deep"])
def test_export_of_an_adapter_step_onto_a_forged_base_is_refused(tmp_path, case):
    world = (tmp_path / "world").resolve()
    base, f = _forged(world, PRETRAIN, "items", case)
    lora = L.copy_tree(L.FIXTURE / LORA, world / "adapters" / LORA)
    alpha = f"{L.generator().LORA_ALPHA:g}"
    out = world / "hf"
    before = H.snapshot(world)
    res = _export(tmp_path, lora, "--base", base, "--alpha", alpha, "--out", out, bait=f.bait)
    _assert_refused(res, f)
    assert H.snapshot(world) == before


def test_the_unforged_step_exports(tmp_path):
    """The control: the same step, its table re-encoded as it was, exports."""
    import ocdbt_craft as C

    world = (tmp_path / "world").resolve()
    step = L.copy_tree(L.FIXTURE / SFT, world / "run" / SFT)
    C.retable(step / "model_params", lambda b, r: (b, r))
    res = _export(tmp_path, step, "--out", world / "hf", bait=[])
    assert res.returncode == 0, res.stdout + res.stderr
    assert (world / "hf" / "config.json").is_file()
    assert os.listdir(world / "hf")
