"""Issue 46: an OCDBT item whose B-tree names data files outside the item is refused, and
nothing outside it is read.

Each item is forged from a real one (`hostile_support.forge`, through `ocdbt_craft`): its
data-file table is rewritten to point outside, where a real file waits (the bait: the item's
own data files moved out, another checkpoint's, a private file), so that a reader following
the table would succeed; only a refusal keeps it out. Stock tensorstore refuses such keys
("Invalid key"); this package must refuse them too, before opening anything, with
`CheckpointReadError` ("data file path leaves the checkpoint", naming the item, the key and
the path), in `ItemReader.open` and in `ocdbt.damaged_value_files`; every command exits 1
with a one-line error and writes nothing.

The cases (`hostile_support.CASES`): ``../../outside/d/<hex>``, an absolute relative path, an
absolute base path, another checkpoint's data file, a file that is no checkpoint's, and
``../`` x 30 then the absolute path (the same file from the source item and from a grafted
output). The items: Tunix's RL ``model_params``, MaxText's ``items``, the LoRA step's
``model_params`` (its chunks moved out of line first: Orbax wrote them all inline), and an item
written here by stock Orbax holding one 2 MiB array, which the fast reader streams with
zstandard from its data file (`chunks`), not through tensorstore.

Nothing outside is touched: the commands run under strace (`hostile_support.traced`), and no
system call may name a bait path. Without strace those checks are skipped, with a reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import forked_cli
import hostile_support as H
import numpy as np
import ocdbt_craft as C
import pytest
from conftest import FIXTURES, MAXTEXT_NATIVE, RL_ACTOR_STEPS, child_env, copy_fixture
from etils import epath

from orbax_maxtext_layout import CheckpointReadError
from orbax_maxtext_layout.orbax_io import item_writer, ocdbt
from orbax_maxtext_layout.orbax_io.reader import ItemReader

ROOT = Path(__file__).parent.parent
RL = RL_ACTOR_STEPS["tunix017_rl"]
DPO = "tunix017/dpo_run/checkpoints/1"  # unscanned: for --stack
LORA = "tunix017/sft_lora_run/checkpoints/1"
NATIVE = "maxtext_native/run/checkpoints/2"
BIG_NAME = "params.params.big"
LEAVES = "leaves the checkpoint"
needs_strace = pytest.mark.skipif(
    not H.STRACE, reason="strace is not installed, or may not trace here"
)


def _chunks_only(e: C.Entry) -> bool:
    """Orbax keeps zarr metadata inline; the chunks are what a reader opens a file for."""
    return not e.key.endswith((b".zarray", b"zarr.json"))


def _prepare_lora(item: Path) -> None:
    C.externalize(item, _chunks_only)


@pytest.fixture(scope="module")
def big_step(tmp_path_factory) -> Path:
    """A step whose ``items`` holds ``params/params/big``, float32 1024x512 (2 MiB: past
    `zarr.SMALL`, so `chunks.read_whole` streams its one zstd chunk from its data file),
    written by stock Orbax."""
    import orbax.checkpoint as ocp

    step = tmp_path_factory.mktemp("big") / "run" / "1"
    step.mkdir(parents=True)
    big = np.random.default_rng(46).standard_normal((1024, 512)).astype(np.float32)
    ocp.PyTreeCheckpointer().save(epath.Path(step / "items"), {"params": {"params": {"big": big}}})
    np.save(step.parent.parent / "big.npy", big)
    return step


def _world(tmp_path: Path) -> Path:
    world = (tmp_path / "world").resolve()
    world.mkdir()
    return world


def forged_step(
    world: Path, source: Path | str, item: str, case: str, prepare=None
) -> tuple[Path, H.Forged]:
    """A copy of step ``source`` (a fixture name or a directory) under ``world/run`` with its
    ``item`` forged as ``case``; for "victim", a second copy under ``world/victim``."""
    if isinstance(source, str):
        step = copy_fixture(source, world / "run")
    else:
        step = world / "run" / source.name
        shutil.copytree(source, step)
    if prepare is not None:
        prepare(step / item)
    victim = None
    if case == "victim":
        victim = world / "victim" / "checkpoints" / step.name
        shutil.copytree(step, victim)
        victim = victim / item
    return step, H.forge(step / item, case, world, victim=victim)


def _assert_refusal(e: BaseException, f: H.Forged) -> None:
    msg = str(e)
    assert isinstance(e, CheckpointReadError), repr(e)
    assert LEAVES in msg, msg
    assert str(f.item) in msg, msg
    assert H.names_offender(msg, f), msg
    keys = [x.key.decode() for x in C.leaf_entries(f.item) if x.inline is None]
    assert any(k in msg for k in keys), msg


ITEMS = {
    "rl": (RL, "model_params", None),
    "native": (NATIVE, "items", None),
    "lora": (LORA, "model_params", _prepare_lora),
    "big": (None, "items", None),
}


def _forge_kind(kind: str, case: str, world: Path, big_step: Path) -> tuple[Path, H.Forged]:
    source, item, prepare = ITEMS[kind]
    return forged_step(world, source or big_step, item, case, prepare)


# -- the library: refused when opened, named by damaged_value_files ------------------------
@pytest.mark.parametrize("case", H.CASES)
@pytest.mark.parametrize("kind", ITEMS)
def test_open_refuses_before_any_data_file(tmp_path, big_step, kind, case):
    """`ItemReader.open` walks the B-tree (nodes only) and refuses the item: no `ItemReader`
    is returned, so `chunks.read_whole` (or any reader) has nothing to read through."""
    _, f = _forge_kind(kind, case, _world(tmp_path), big_step)
    with pytest.raises(CheckpointReadError) as e:
        ItemReader.open(epath.Path(f.item), item_writer.ts_context())
    _assert_refusal(e.value, f)


@pytest.mark.parametrize("case", H.CASES)
@pytest.mark.parametrize("kind", ITEMS)
def test_damaged_value_files_says_it_leaves_the_checkpoint(tmp_path, big_step, kind, case):
    _, f = _forge_kind(kind, case, _world(tmp_path), big_step)
    bad = ocdbt.damaged_value_files(epath.Path(f.item))
    for p in f.offending:
        assert LEAVES in bad.get(p, ""), (p, bad)
        assert "missing" not in bad[p] and "bytes" not in bad[p], bad[p]


def test_the_unforged_items_open_and_read(tmp_path, big_step):
    """The control: the same items, re-encoded with their own table, open and read whole
    through the fast reader, and `damaged_value_files` finds nothing."""
    from orbax_maxtext_layout.orbax_io import item_writer, ocdbt
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    step = tmp_path / "1"
    shutil.copytree(big_step, step)
    C.retable(step / "items", lambda b, r: (b, r))
    src = ItemReader.open(epath.Path(step / "items"), item_writer.ts_context())
    assert src.value_file(f"{BIG_NAME}/0.0") is not None  # streamed from its data file
    got = src.read_whole(BIG_NAME)
    assert np.array_equal(got, np.load(big_step.parent.parent / "big.npy"))
    assert ocdbt.damaged_value_files(epath.Path(step / "items")) == {}


def test_every_value_of_a_tree_of_many_nodes_is_located(tmp_path):
    """MaxText's items copied key by key into a database of small nodes (height > 0): the
    same item to any reader, and `ItemReader.value_file` locates every indirect value."""
    import tensorstore as ts

    src = FIXTURES / NATIVE / "items"
    item = tmp_path / "items"
    shutil.copytree(src, item, ignore=shutil.ignore_patterns("d", "ocdbt.process_*", "manifest*"))
    old = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{src}/"}).result()
    config = {"max_decoded_node_bytes": 1024, "max_inline_value_bytes": 16}
    new = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/", "config": config})
    new = new.result()
    txn = ts.Transaction()
    for k in old.list().result():
        new.with_transaction(txn)[k] = old[k]
    txn.commit_sync()
    assert C.dump_manifest(item)["versions"][-1]["root_height"] > 0
    entries = [e for e in C.leaf_entries(item) if e.inline is None]
    opened = ItemReader.open(epath.Path(item), item_writer.ts_context())
    missed = [e.key for e in entries if opened.value_file(e.key.decode()) is None]
    assert missed == []


# -- nothing outside is touched: the library in a child under strace --------------------------
READER = textwrap.dedent(
    """
    import sys
    from etils import epath
    from orbax_maxtext_layout import CheckpointReadError
    from orbax_maxtext_layout.orbax_io import item_writer, ocdbt
    from orbax_maxtext_layout.orbax_io.reader import ItemReader
    item, name = epath.Path(sys.argv[1]), sys.argv[2]
    print("damaged:", ocdbt.damaged_value_files(item))
    try:
        src = ItemReader.open(item, item_writer.ts_context())
        src.read_whole(name)
    except CheckpointReadError as e:
        print("refused:", e)
        sys.exit(1)
    print("read")
    """
)


@needs_strace
@pytest.mark.parametrize("case", H.PROCESS_CASES)
def test_the_fast_reader_touches_nothing_outside(tmp_path, big_step, case):
    """`damaged_value_files`, `ItemReader.open` and `chunks.read_whole` of the 2 MiB array
    (the path that reads data files itself) in a child process under strace: refused, and no
    system call names the bait."""
    world = _world(tmp_path)
    _, f = _forge_kind("big", case, world, big_step)
    log = tmp_path / "strace.log"
    argv = [sys.executable, "-c", READER, str(f.item), BIG_NAME]
    res = H.traced(argv, log, cwd=ROOT, env=child_env())
    assert res.returncode == 1 and "refused:" in res.stdout, res.stdout + res.stderr
    assert LEAVES in res.stdout and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert H.touched(log, f.bait, cwd=ROOT) == []


@needs_strace
def test_the_tracer_sees_every_way_of_naming_the_bait(tmp_path):
    """The control for `H.touched`: a child that reaches the bait by an absolute path, by
    ``..`` from an item, by a path relative to its working directory or to a directory fd,
    by ``../`` x 30, or only stats it, is caught; one that reads beside it is not."""
    world = _world(tmp_path)
    bait = world / "outside" / "d" / "cafe"
    bait.parent.mkdir(parents=True)
    bait.write_bytes(b"bait")
    (world / "outside" / "other").write_bytes(b"not bait")
    item = world / "run" / "2" / "items"
    item.mkdir(parents=True)
    ways = {
        "absolute": f"open({str(bait)!r}).read()",
        "dotdot": f"open({str(item)!r} + '/../../../outside/d/cafe').read()",
        "cwd": "open('../../../outside/d/cafe').read()",
        "dir_fd": (
            f"import os; fd = os.open({str(bait.parent.parent)!r}, os.O_RDONLY); "
            "os.close(os.open('d/cafe', os.O_RDONLY, dir_fd=fd))"
        ),
        "deep": f"open('../' * 30 + {str(bait).lstrip('/')!r}).read()",
        "stat": f"import os; os.stat({str(bait)!r})",
    }
    log = tmp_path / "strace.log"
    for way, code in ways.items():
        res = H.traced([sys.executable, "-c", code], log, cwd=item)
        assert res.returncode == 0, res.stderr
        assert H.touched(log, [bait], cwd=item), way
    res = H.traced([sys.executable, "-c", "open('../../../outside/other').read()"], log, cwd=item)
    assert res.returncode == 0 and H.touched(log, [bait], cwd=item) == []


# -- the command line --------------------------------------------------------------------
@pytest.mark.skipif(not H.STRACE, reason="strace is not installed or may not trace here")
def test_the_tracer_attached_to_a_forked_command_sees_its_reads(tmp_path):
    """The control for `run_cli`'s traced commands: strace attached to the forked child
    before it starts (`forked_cli.run_cli(trace=...)`) logs the files the command reads (the
    step's item metadata and data), from the fork on (no interpreter's start)."""
    step = copy_fixture(RL, tmp_path / "run")
    log = tmp_path / "strace.log"
    res = forked_cli.run_cli("inspect", step, "--json", cwd=ROOT, trace=H.strace_argv(log))
    assert res.returncode == 0, res.stderr
    assert H.touched(log, [step / "model_params" / "_METADATA"], cwd=ROOT)
    assert H.touched(log, [step / "model_params" / "d"], cwd=ROOT)
    assert "execve(" not in log.read_text()  # no interpreter started: the fork was traced


def run_cli(
    tmp_path: Path, *args: object, bait: list[Path] = (), env: dict | None = None
) -> subprocess.CompletedProcess:
    """``orbax-maxtext-layout ARGS`` forked from a warm interpreter (`forked_cli.run_cli`);
    with ``bait``, under strace where there is one (attached before the command starts),
    then asserting no system call named the bait. A ``PYTHONPATH`` in ``env`` (read when
    Python starts) takes a fresh interpreter, traced from its start."""
    argv = [sys.executable, "-m", "orbax_maxtext_layout", *map(str, args)]
    log = tmp_path / "strace.log"
    trace = H.strace_argv(log) if H.STRACE and bait else None
    if not (env and "PYTHONPATH" in env):
        res = forked_cli.run_cli(*args, env=env, cwd=ROOT, trace=trace)
    elif trace is None:
        env = child_env(env, cpu=False)  # the CLI pins the CPU itself
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    else:
        res = H.traced(argv, log, cwd=ROOT, env=child_env(env, cpu=False))
    if trace is not None:
        hits = H.touched(log, bait, cwd=ROOT)
        assert hits == [], "\n".join(hits[:20])
    return res


def _assert_cli_refusal(res: subprocess.CompletedProcess, f: H.Forged, *, item=None) -> None:
    """Exit 1, no traceback, and an error line naming the item (``item``: where the command
    read it, e.g. after renumbering), the key and the forged path."""
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Traceback" not in out, out
    errors = [line for line in res.stderr.splitlines() if LEAVES in line]
    assert errors, out
    where = str(item or f.item)
    assert any(where in line and H.names_offender(line, f) for line in errors), out


def _renumbered(step: Path) -> Path:
    """Where the CLI's default renumbering moves Tunix step ``N`` (MaxText's ``N - 1``)."""
    return step.parent / str(int(step.name) - 1)


def _unchanged(before: dict, world: Path, *, moved: tuple[Path, Path] | None = None) -> bool:
    """Nothing under ``world`` written, removed or changed since ``before`` (`H.snapshot`);
    ``moved=(src, dst)``: except that directory ``src`` is now ``dst``, with its update count
    recorded in its ``_CHECKPOINT_METADATA`` (the renumbering's own record), its other files
    the same."""
    after = H.snapshot(world)
    if moved is not None:
        src, dst = (str(p.relative_to(world)) for p in moved)
        after = {
            (src + k[len(dst) :] if k == dst or k.startswith(dst + "/") else k): v
            for k, v in after.items()
        }
        meta = f"{src}/_CHECKPOINT_METADATA"
        before = {**before, meta: after.get(meta)}
    return after == before


def _unscanned_target(tmp_path: Path) -> dict:
    mod = tmp_path / "targets" / "unscanned_native.py"
    mod.parent.mkdir()
    mod.write_text(
        "import orbax_maxtext_layout as o\n\n\n"
        "def target():\n"
        f"    return o.unroll_target(o.Target.from_checkpoint({str(MAXTEXT_NATIVE)!r}))\n"
    )
    return {"PYTHONPATH": str(mod.parent)}


# (fixture, extra arguments) of each way to convert a step
MODES = {
    "default": (RL, []),
    "copy": (RL, ["--copy"]),
    "in-place": (RL, ["--in-place"]),
    "out": (RL, ["--out", "{world}/converted"]),
    "unroll": (RL, ["--target", "unscanned_native:target", "--unroll"]),
    "stack": (DPO, ["--target-from", str(MAXTEXT_NATIVE), "--stack", "--optimizer", "drop"]),
}
# every case in the two plain modes; the cases that differ most in the others
MODE_CASES = [(m, c) for m in ("default", "copy") for c in H.PROCESS_CASES] + [
    (m, c)
    for m in ("in-place", "out", "unroll", "stack")
    for c in (("outside", "absolute_base", "deep") if H.FULL else ("deep",))
]


@pytest.mark.parametrize(("mode", "case"), MODE_CASES)
def test_convert_refuses_and_writes_nothing(tmp_path, mode, case):
    fixture, extra = MODES[mode]
    world = _world(tmp_path)
    step, f = forged_step(world, fixture, "model_params", case)
    env = _unscanned_target(tmp_path) if mode == "unroll" else None
    if "--target" not in extra and "--target-from" not in extra:
        extra = ["--target-from", str(MAXTEXT_NATIVE), *extra]
    extra = [a.format(world=world) for a in extra]
    before = H.snapshot(world)
    res = run_cli(tmp_path, "convert", step, *extra, bait=f.bait, env=env)
    # The default renumbering moves the step to MaxText's number before it is converted
    # (`test_a_refused_step_keeps_its_number`); the refusal names the item where it was read.
    moved = (step, _renumbered(step)) if _renumbered(step).exists() else None
    read_at = moved[1] / "model_params" if moved else None
    _assert_cli_refusal(res, f, item=read_at)
    for where in (step, _renumbered(step)):
        assert not (where / "items").exists()
    # no items/, no temp dir, no file changed (the bait neither)
    assert _unchanged(before, world, moved=moved)


def test_a_refused_step_keeps_its_number(tmp_path):
    world = _world(tmp_path)
    step, f = forged_step(world, RL, "model_params", "outside")
    before = H.snapshot(world)
    res = run_cli(tmp_path, "convert", step, "--target-from", MAXTEXT_NATIVE, bait=f.bait)
    assert res.returncode == 1, res.stdout + res.stderr
    assert step.is_dir() and not _renumbered(step).exists()
    assert _unchanged(before, world)


@pytest.mark.parametrize("case", H.PROCESS_CASES)
def test_verify_of_a_step_whose_legacy_item_was_forged_is_not_ok(tmp_path, case):
    """A step converted cleanly, then its legacy ``model_params`` forged: `verify` compares
    the two and must not read the legacy item's table through, nor say "ok"."""
    world = _world(tmp_path)
    step = copy_fixture(RL, world / "run")
    res = run_cli(tmp_path, "convert", step, "--target-from", MAXTEXT_NATIVE, "--keep-step-numbers")
    assert res.returncode == 0, res.stdout + res.stderr
    victim = None
    if case == "victim":
        victim = world / "victim" / "checkpoints" / step.name
        shutil.copytree(step, victim)
        victim = victim / "model_params"
    f = H.forge(step / "model_params", case, world, victim=victim)
    before = H.snapshot(world)
    res = run_cli(tmp_path, "verify", step, "--json", bait=f.bait)
    out = res.stdout + res.stderr
    assert res.returncode not in (0, None), out
    assert "Traceback" not in out, out
    assert LEAVES in out, out
    if res.stdout.strip():
        assert not any(r.get("ok") for r in json.loads(res.stdout)), out
    assert _unchanged(before, world)


@pytest.mark.parametrize("case", H.CASES[-1:] if not H.FULL else ["outside", "deep"])
def test_verify_of_a_step_whose_items_were_forged_is_not_ok(tmp_path, case):
    """The converted ``items`` (its grafted sub-databases' files) forged instead."""
    world = _world(tmp_path)
    step = copy_fixture(RL, world / "run")
    res = run_cli(tmp_path, "convert", step, "--target-from", MAXTEXT_NATIVE, "--keep-step-numbers")
    assert res.returncode == 0, res.stdout + res.stderr
    f = H.forge(step / "items", case, world)
    before = H.snapshot(world)
    res = run_cli(tmp_path, "verify", step, bait=f.bait)
    out = res.stdout + res.stderr
    assert res.returncode not in (0, None) and "Traceback" not in out, out
    assert LEAVES in out and ": ok" not in res.stdout, out
    assert _unchanged(before, world)


@pytest.mark.parametrize("case", H.PROCESS_CASES)
def test_merge_lora_of_a_forged_adapter_step(tmp_path, case):
    world = _world(tmp_path)
    step, f = forged_step(world, LORA, "model_params", case, _prepare_lora)
    _assert_merge_refused(tmp_path, world, (step, MAXTEXT_NATIVE / "items"), f)


@pytest.mark.parametrize("case", H.PROCESS_CASES)
def test_merge_lora_onto_a_forged_base(tmp_path, case):
    world = _world(tmp_path)
    base, f = forged_step(world, NATIVE, "items", case)
    lora = copy_fixture(LORA, world / "adapters")
    _assert_merge_refused(tmp_path, world, (lora, base / "items"), f)


def _assert_merge_refused(tmp_path: Path, world: Path, sources: tuple, f) -> None:
    """``merge-lora ADAPTER --base BASE`` refused before anything is written: the plan
    checks both sources' data files, so not even ``--out`` is made."""
    before = H.snapshot(world)
    out = world / "merged"
    adapter, base = sources
    argv = ("merge-lora", adapter, "--base", base, "--alpha", 4, "--out", out)
    res = run_cli(tmp_path, *argv, bait=f.bait)
    _assert_cli_refusal(res, f)
    assert not out.exists()
    assert _unchanged(before, world)


def test_the_unforged_steps_convert_and_merge(tmp_path):
    """The control for the command-line cases: the same steps, their tables re-encoded as
    they were (the LoRA step's chunks moved out of line too), convert and merge."""
    world = _world(tmp_path)
    step = copy_fixture(RL, world / "run")
    C.retable(step / "model_params", lambda b, r: (b, r))
    res = run_cli(tmp_path, "convert", step, "--target-from", MAXTEXT_NATIVE, "--keep-step-numbers")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli(tmp_path, "verify", step)
    assert res.returncode == 0 and ": ok" in res.stdout, res.stdout + res.stderr
    lora = copy_fixture(LORA, world / "adapters")
    _prepare_lora(lora / "model_params")
    out = world / "merged"
    args = ["merge-lora", lora, "--base", MAXTEXT_NATIVE / "items", "--alpha", 4, "--out", out]
    res = run_cli(tmp_path, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out / "0" / "items").is_dir()
