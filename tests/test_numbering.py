"""`convert` gives converted steps MaxText's numbers: Tunix directory N (the state after N
updates) becomes directory N - 1, which is where MaxText keeps that state."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FIXTURES, MAXTEXT_NATIVE, copy_fixture, restore_flat, tree_digest
from orbax.checkpoint.experimental import v1 as ocp1
from test_cli import cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.orbax_io import stepdir
from orbax_maxtext_layout.storage.store import store_for

MODEL_ONLY = FIXTURES / "tunix_snapshot_v1/sft_model_only/checkpoints/1"  # step from the name
RL = FIXTURES / "tunix017/rl_run/checkpoints/actor/2"


def _run(tmp_path, numbers, src=MODEL_ONLY):
    root = tmp_path / "run" / "checkpoints"
    for n in numbers:
        shutil.copytree(src, root / str(n))
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def _convert(root, *extra, check_rc=0):
    args = ["convert", str(root), "--target-from", str(MAXTEXT_NATIVE), "--optimizer", "drop"]
    return cli(*args, *extra, "--json", check_rc=check_rc)


def test_tunix_steps_take_maxtext_numbers_and_keep_their_step(tmp_path):
    root = _run(tmp_path, [1, 2, 3])
    reports = json.loads(_convert(root).stdout)
    assert [(r["status"], r["step_dir"]) for r in reports] == [
        ("converted", str(root / str(n))) for n in (0, 1, 2)
    ]
    assert all("moved to" in r["notes"][0] for r in reports)
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", "2"]
    for n in (0, 1, 2):
        assert oml.detect_layout(root / str(n)) is oml.Layout.MAXTEXT
        assert int(restore_flat(root / str(n) / "items")[("step",)]) == n + 1
        prov = oml.converted_provenance(root / str(n))
        assert prov["numbering"] == "maxtext" and prov["tunix_directory"] == str(n + 1)
        assert oml.tunix_step_number(root / str(n)) == n + 1
        assert oml.verify_step(root / str(n)).ok
    # What a stock manager (MaxText's resume) sees: steps 0..2, resuming at items/step 3.
    with ocp.CheckpointManager(root, item_names=("items",)) as mngr:
        assert mngr.all_steps() == [0, 1, 2] and mngr.latest_step() == 2
    # A rerun finds everything converted.
    assert {r["status"] for r in json.loads(_convert(root).stdout)} == {"skipped"}


def test_keep_step_numbers_keeps_tunix_numbers(tmp_path):
    root = _run(tmp_path, [1, 2])
    reports = json.loads(_convert(root, "--keep-step-numbers").stdout)
    assert [r["step_dir"] for r in reports] == [str(root / "1"), str(root / "2")]
    assert int(restore_flat(root / "2" / "items")[("step",)]) == 2
    assert "numbering" not in oml.converted_provenance(root / "2")


def test_tunix_directory_zero_is_skipped_with_a_reason(tmp_path):
    root = _run(tmp_path, [0, 2])
    before = tree_digest(root / "0")
    reports = json.loads(_convert(root).stdout)
    assert [r["status"] for r in reports] == ["skipped", "converted"]
    assert "before any update" in reports[0]["notes"][0]
    assert "--keep-step-numbers" in reports[0]["notes"][0]
    assert tree_digest(root / "0") == before  # untouched
    assert oml.detect_layout(root / "1") is oml.Layout.MAXTEXT
    # The plain output gives the reason too (not "already has items/").
    args = ["convert", str(root), "--target-from", str(MAXTEXT_NATIVE), "--optimizer", "drop"]
    out = cli(*args).stdout
    assert f"{root / '0'}: skipped (Tunix directory 0 holds the state before any update" in out
    assert f"{root / '1'}: skipped (already has items/)" in out
    # Tunix 1 would become 0, where Tunix 0 still is: refused, naming why; nothing lost.
    root = _run(tmp_path / "b", [0, 1])
    before = tree_digest(root)
    res = _convert(root, check_rc=1)
    assert "initial state" in res.stderr and "--keep-step-numbers" in res.stderr
    assert tree_digest(root) == before


def test_a_collision_with_a_maxtext_step_is_refused_and_nothing_moves(tmp_path):
    root = _run(tmp_path, [2])
    shutil.copytree(MAXTEXT_NATIVE, root / "1")  # a MaxText step already at 1
    before = tree_digest(root)
    res = _convert(root, check_rc=1)
    assert "StepExistsError" in res.stderr and str(root / "1") in res.stderr
    assert "--keep-step-numbers" in res.stderr
    assert tree_digest(root) == before
    # With Tunix's numbering the same run converts.
    _convert(root, "--keep-step-numbers")
    assert oml.detect_layout(root / "2") is oml.Layout.MAXTEXT


def test_dry_run_says_where_a_step_would_go_and_moves_nothing(tmp_path):
    root = _run(tmp_path, [3])
    before = tree_digest(root)
    (report,) = json.loads(_convert(root, "--dry-run").stdout)
    assert report["status"] == "dry-run" and "would move to 2" in report["notes"][0]
    assert tree_digest(root) == before


def test_out_writes_maxtext_numbers_and_leaves_the_source(tmp_path):
    root = _run(tmp_path, [2], src=RL)
    before = tree_digest(root)
    out = tmp_path / "out"
    (report,) = json.loads(_convert(root, "--out", str(out)).stdout)
    assert report["step_dir"] == str(out / "1") and report["status"] == "converted"
    assert tree_digest(root) == before
    assert oml.tunix_step_number(out / "1") == 2
    assert int(restore_flat(out / "1" / "items")[("step",)]) == 2  # the optimizer's step


def test_a_step_moved_but_not_converted_is_converted_by_the_rerun(tmp_path):
    """The state a kill between the renumbering and the conversion leaves."""
    root = _run(tmp_path, [4])
    stepdir.renumber_step(root / "4", root / "3", 4, store=store_for(root))
    assert oml.detect_layout(root / "3") is oml.Layout.TUNIX
    assert not [p.name for p in (root / "3").iterdir() if p.name.endswith(".lock")]
    (report,) = json.loads(_convert(root).stdout)
    assert report["status"] == "converted" and report["step_dir"] == str(root / "3")
    assert int(restore_flat(root / "3" / "items")[("step",)]) == 4


def test_a_run_directory_names_where_its_steps_are(tmp_path):
    root = _run(tmp_path, [1])
    run = root.parent
    for cmd in (["convert", str(run), "--target-from", str(MAXTEXT_NATIVE)], ["inspect", str(run)]):
        res = cli(*cmd, check_rc=1)
        assert f"no steps found in {run}" in res.stderr and str(root) in res.stderr
    res = cli("verify", str(run), check_rc=1)
    assert str(root) in res.stderr
    # An empty directory is still just "no steps found".
    (tmp_path / "empty").mkdir()
    res = cli("convert", str(tmp_path / "empty"), "--target-from", str(MAXTEXT_NATIVE))
    assert "no steps found" in res.stdout


def test_the_api_keeps_numbers_unless_asked(tmp_path):
    step = copy_fixture("tunix_snapshot_v1/sft_model_only/checkpoints/1", tmp_path)
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    report = oml.convert_step(step, target, optimizer="drop")
    assert report.step_dir == str(step)
    other = copy_fixture("tunix_snapshot_v1/sft_model_only/checkpoints/1", tmp_path / "b")
    shutil.move(other, other.parent / "5")
    report = oml.convert_step(other.parent / "5", target, optimizer="drop", renumber=True)
    assert report.step_dir == str(other.parent / "4")
    got = restore_flat(other.parent / "4" / "items")
    assert got[("step",)].dtype == np.int32 and int(got[("step",)]) == 5


def _sharded_abstract(step):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
        oml.Target.from_checkpoint(step).items(),
    )


def _v1_context():
    ctx = ocp1.Context()
    ctx.pytree.loading.partial_load = True  # as MaxText's build_context sets it
    return ctx


def test_a_converted_run_reads_with_stock_v1_and_v0_like_a_native_maxtext_step(tmp_path):
    """MaxText 0.2.5's own model: its Tunix SFT step, converted by the CLI, next to the
    pre-training step MaxText's loop wrote for the same update count."""
    fixture = FIXTURES / "maxtext025"
    native_root = fixture / "pretrain_run" / "checkpoints"
    root = tmp_path / "sft" / "checkpoints"
    shutil.copytree(fixture / "sft_run" / "checkpoints", root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    cli("convert", str(root), "--target-from", str(native_root / "1"), "--remove-legacy")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["1"]
    abstract = _sharded_abstract(native_root / "1")
    loaded = {}
    for name, r in (("native", native_root), ("converted", root)):
        with ocp1.training.Checkpointer(r, context=_v1_context()) as ckptr:
            assert ckptr.latest.step == 1
            loaded[name] = ckptr.load_checkpointables(1, {"items": abstract})["items"]
            params_only = ckptr.load_checkpointables(1, {"items": {"params": abstract["params"]}})
            assert set(params_only["items"]) == {"params"}
    got, want = loaded["converted"], loaded["native"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.sharding == b.sharding
    assert int(got["step"]) == int(want["step"]) == 2  # both: the state after 2 updates
    meta = json.loads((root / "1" / "_CHECKPOINT_METADATA").read_text())
    assert set(meta["item_handlers"]) == {"items"}  # the legacy entries went with them
    rargs = ocp.checkpoint_utils.construct_restore_args(abstract)  # abstract's shardings
    with ocp.CheckpointManager(root, item_names=("items",)) as mngr:  # stock v0
        items = ocp.args.PyTreeRestore(item=abstract, restore_args=rargs)
        v0 = mngr.restore(1, args=ocp.args.Composite(items=items))
    for a, b in zip(jax.tree.leaves(v0["items"]), jax.tree.leaves(got), strict=True):
        assert np.array_equal(_raw(a), _raw(b))


def _raw(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


# -- the run plan: the dry run reports what the real run does ----------------------------------
_MOVE = re.compile(r"Tunix directory (\d+) (?:would move|moved) to (\d+)")


def _outcomes(reports: list[dict]) -> list[tuple[str, str, tuple]]:
    """Per listed step: its outcome (a dry run's 'dry-run' is the real run's 'converted') and
    the moves its notes report."""
    out = []
    for r in reports:
        status = "converted" if r["status"] == "dry-run" else r["status"]
        moves = tuple(m.groups() for n in r["notes"] for m in [_MOVE.search(n)] if m)
        where = Path(r["step_dir"])
        listed = where.parent / moves[0][0] if moves else where
        out.append((str(listed), status, moves))
    return sorted(out)


def _held(step: Path) -> None:
    """A live process (this one) holds the step's lock, as a converter busy with it does."""
    owner = {"pid": os.getpid(), "host": socket.gethostname()}
    (step / ".orbax-maxtext-layout.lock").write_text(json.dumps(owner))


def _scenario(tmp_path, name):
    if name == "roles":
        root = tmp_path / "run" / "checkpoints"
        for role in ("actor", "critic"):
            for n in (1, 2, 3):
                shutil.copytree(MODEL_ONLY, root / role / str(n))
        return root
    numbers = {"consecutive": [1, 2, 3], "gaps": [2, 5, 9], "tunix_zero": [0, 1, 2]}
    root = _run(tmp_path, numbers.get(name, [2, 3, 4]))
    if name == "maxtext_at_n_minus_1":
        shutil.copytree(MAXTEXT_NATIVE, root / "1")  # a MaxText step already at 1
    if name == "held":
        _held(root / "3")
    return root


@pytest.mark.parametrize(
    "name", ["consecutive", "gaps", "tunix_zero", "maxtext_at_n_minus_1", "held", "roles"]
)
def test_dry_run_reports_what_the_real_run_does(tmp_path, name):
    dry_root = _scenario(tmp_path / "dry", name)
    real_root = _scenario(tmp_path / "real", name)
    before = tree_digest(dry_root)
    dry = _convert(dry_root, "--dry-run", check_rc=None)
    assert tree_digest(dry_root) == before  # the dry run moves and writes nothing
    real = _convert(real_root, check_rc=None)
    assert dry.returncode == real.returncode, (dry.stderr, real.stderr)
    rel = lambda o: [(str(Path(p).relative_to(r)), s, m) for (p, s, m), r in o]  # noqa: E731
    got_dry = rel([(o, dry_root) for o in _outcomes(json.loads(dry.stdout))])
    got_real = rel([(o, real_root) for o in _outcomes(json.loads(real.stdout))])
    assert got_dry == got_real
    expected = {
        "consecutive": [
            ("1", "converted", (("1", "0"),)),
            ("2", "converted", (("2", "1"),)),
            ("3", "converted", (("3", "2"),)),
        ],
        "gaps": [
            ("2", "converted", (("2", "1"),)),
            ("5", "converted", (("5", "4"),)),
            ("9", "converted", (("9", "8"),)),
        ],
        # Tunix 0 stays (no MaxText number), so 1 cannot take its place, nor 2 take 1's.
        "tunix_zero": [("0", "skipped", ()), ("1", "failed", ()), ("2", "failed", ())],
        "maxtext_at_n_minus_1": [
            ("1", "skipped", ()),
            ("2", "failed", ()),
            ("3", "failed", ()),
            ("4", "failed", ()),
        ],
        # 3 is held where it is; 2 moves to 1; 4 waits behind 3 (reported, not failed).
        "held": [("2", "converted", (("2", "1"),)), ("3", "locked", ()), ("4", "locked", ())],
        "roles": [
            (f"{role}/{n}", "converted", ((str(n), str(n - 1)),))
            for role in ("actor", "critic")
            for n in (1, 2, 3)
        ],
    }[name]
    assert got_real == expected
    if name in ("tunix_zero", "maxtext_at_n_minus_1"):
        assert "StepExistsError" in real.stderr and "StepExistsError" in dry.stderr


def _converters(root: Path, n: int) -> list[subprocess.Popen]:
    args = ["convert", str(root), "--target-from", str(MAXTEXT_NATIVE), "--optimizer", "drop"]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "orbax_maxtext_layout", *args, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        for _ in range(n)
    ]


REPEATS = 12 if os.environ.get("OMTL_RELIABILITY_FULL", "") not in ("", "0") else 3


# The first race in the README's test command; the others in .ci/run's slow pass (each is
# three fresh converters racing: about 10 s)
RACES = [r if r == 0 else pytest.param(r, marks=pytest.mark.slow) for r in range(REPEATS)]


@pytest.mark.parametrize("repeat", RACES)
def test_concurrent_renumbering_converters_never_fail_falsely(tmp_path, repeat):
    """Three converters started together on one run of six Tunix steps, renumbering: each
    step is moved and converted exactly once, every converter exits 0, nothing is lost."""
    root = _run(tmp_path, [1, 2, 3, 4, 5, 6])
    procs = _converters(root, 3)
    results = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    for _, err, rc in results:
        assert rc == 0, err[-3000:]
    reports = [r for out, _, _ in results for r in json.loads(out)]
    converted = sorted(r["step_dir"] for r in reports if r["status"] == "converted")
    assert converted == sorted(str(root / str(n)) for n in range(6))  # once each
    assert not [r for r in reports if r["status"] == "failed"]
    assert sorted(p.name for p in root.iterdir()) == [str(n) for n in range(6)]
    for n in range(6):
        assert int(restore_flat(root / str(n) / "items")[("step",)]) == n + 1
        assert oml.tunix_step_number(root / str(n)) == n + 1
        assert oml.verify_step(root / str(n)).ok


def test_a_step_moved_by_another_converter_while_the_run_is_planned(tmp_path):
    """Another converter renumbers steps while this run plans (in CI this once ended the
    CLI with a raw FileNotFoundError on a moved step's metadata): the run plan takes each
    step's update count from its plan (no second read of a directory that may be gone),
    and the moves planned again under the lock find each step where the other put it."""
    from orbax_maxtext_layout.plan import renumbering

    root = _run(tmp_path, [1, 2, 3])
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)

    def plan_of(step_dir):
        plan = oml.plan_step(step_dir, target, optimizer="drop")
        if step_dir == root / "1" and not (root / "0").exists():
            store = store_for(root)  # the other converter's moves: 1 -> 0, then 2 -> 1
            stepdir.renumber_step(step_dir, root / "0", 1, store=store)
            stepdir.renumber_step(root / "2", root / "1", 2, store=store)
        return plan

    infos = oml.find_steps(root)
    placed = renumbering.plan_run(infos, plan_of, store=store_for(root))
    # Outside the lock, 1's move sees 0 taken (by 1 itself) and 2 is gone: both are planned
    # again under the lock, by their update counts.
    assert [type(p.error).__name__ for p in placed] == [
        "StepExistsError",
        "CheckpointReadError",
        "NoneType",
    ]
    assert [p.tunix for p in placed] == [1, 2, 3]
    made = renumbering.apply_renumbering(placed, plan_of, store=store_for(root))
    assert [(p.error, p.locked) for p in made] == [(None, None)] * 3
    assert [p.path.name for p in made] == ["0", "1", "2"]
    assert (
        made[0].renumbering is None and "moved meanwhile by another converter" in made[0].notes[0]
    )
    assert sorted(p.name for p in root.iterdir()) == ["0", "1", "2"]
    assert [oml.tunix_step_number(root / str(n)) for n in range(3)] == [1, 2, 3]


def test_read_step_metadata_of_a_step_that_vanished_is_a_read_error(tmp_path):
    """The metadata file removed between its existence check and its read (a step moved
    meanwhile) is a CheckpointReadError naming it, which the run plan plans again, not a
    raw FileNotFoundError that ended the CLI."""
    from orbax_maxtext_layout.orbax_io import stepmeta

    step = _run(tmp_path, [1])
    meta = step / "1" / "_CHECKPOINT_METADATA"

    class Vanishing(type(oml.find_steps(step)[0].path)):
        def open(self, *a, **k):  # found by the check, then the step is moved away
            if self.name == "_CHECKPOINT_METADATA":
                os.rename(self.parent, self.parent.parent / "moved")
            return super().open(*a, **k)

    with pytest.raises(oml.CheckpointReadError, match="_CHECKPOINT_METADATA: disappeared"):
        stepmeta.read(Vanishing(step / "1"))
    assert not meta.exists() and (step / "moved" / "_CHECKPOINT_METADATA").exists()
