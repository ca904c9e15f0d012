"""Read-only operations on gs:// (local GCS emulator), compared bit for bit with local disk.

The shipped example (a Tunix RL step and MaxText's step of the same model) is uploaded to a
fresh prefix of the emulator's bucket for each test. Writes are tested in test_gcs_write.py,
test_gcs_crash.py and test_gcs_manager.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import stock_restore
from etils import epath
from forked_cli import run_cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import unflatten as _nest
from orbax_maxtext_layout.orbax_io.orbax_files import io_counts

from .emulator import invalidate_gcsfs_caches

EXAMPLES = Path(oml.EXAMPLES_DIR)
TUNIX_RUN = EXAMPLES / "tunix_rl_run"
TUNIX_STEP = "checkpoints/actor/2"
MAXTEXT_STEP = EXAMPLES / "maxtext_run" / "checkpoints" / "2"

# ---- helpers --------------------------------------------------------------------------------


def _flat(tree) -> dict[str, object]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "dtype"))[0]
    return {jax.tree_util.keystr(p): v for p, v in leaves}


def _raw(x) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and stored bytes of a leaf (a typed PRNG key as its impl + key data)."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(x))
        return f"key<{jax.random.key_impl(x)}>", data.shape, data.tobytes()
    a = np.asarray(x)
    return str(a.dtype), a.shape, a.tobytes()


def assert_bit_equal(got, want) -> None:
    g, w = _flat(got), _flat(want)
    assert sorted(g) == sorted(w)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    diff = [k for k in w if _raw(g[k]) != _raw(w[k])]
    assert not diff, f"leaves differ: {diff}"


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def gs_example(gs_prefix):
    """The example uploaded: ``(gs tunix run root, gs maxtext step)`` as epath Paths."""
    run = gs_prefix.upload(TUNIX_RUN, "tunix_rl_run")
    maxtext = gs_prefix.upload(MAXTEXT_STEP, "maxtext_run/checkpoints/2")
    return run, maxtext


def _abstract_params():
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(MAXTEXT_STEP / "items"))
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta.tree["params"])


# ---- the harness ----------------------------------------------------------------------------


def test_upload_download_round_trip(gs_prefix, tmp_path):
    gs_prefix.upload(TUNIX_RUN, "run")
    back = gs_prefix.download("run", tmp_path / "back")
    assert _digest(back) == _digest(TUNIX_RUN)
    assert gs_prefix.objects("run") == {
        k: (TUNIX_RUN / k).stat().st_size for k in _digest(TUNIX_RUN)
    }


def test_proxy_counts_exact_media_bytes(gcs_emulator, gs_prefix):
    """Downloading an object of known size counts exactly its bytes, whichever client."""
    import gcsfs
    import tensorstore as ts

    size = (5 << 20) + 12345  # more than one 1 MiB proxy block and gcsfs's 5 MiB block
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    name = f"{gs_prefix.prefix}/blob"
    gcs_emulator.put_bytes(name, data)  # straight to the emulator: not counted
    kv = ts.KvStore.open(
        {"driver": "gcs", "bucket": gcs_emulator.bucket, "path": f"{gs_prefix.prefix}/"}
    ).result()
    fs = gcsfs.GCSFileSystem()

    reads = {
        "urllib": lambda: gcs_emulator.get_bytes(name, via_proxy=True),
        "tensorstore": lambda: kv.read("blob").result().value,
        "gcsfs.cat_file": lambda: fs.cat_file(f"{gcs_emulator.bucket}/{name}"),
    }
    for client, read in reads.items():
        with gcs_emulator.measure() as c:
            got = read()
        assert got == data, client
        assert c.media_bytes_down == size, (client, c)
        assert c.media_bytes_up == 0, (client, c)
        assert c.by_kind.get("media_download") == 1, (client, c)

    with gcs_emulator.measure() as c:
        kv.write("copy", data).result()  # tensorstore: one simple media upload
    assert (c.media_bytes_up, c.media_bytes_down, c.by_kind) == (size, 0, {"upload": 1}), c
    assert gcs_emulator.get_bytes(f"{gs_prefix.prefix}/copy") == data

    with gcs_emulator.measure() as c:
        assert epath.Path(gs_prefix.url).joinpath("blob").read_bytes() == data  # gcsfs, open
    assert c.media_bytes_down == size and c.media_bytes_up == 0, c

    snap = gcs_emulator.reset_counts()
    assert snap.requests >= 6 and gcs_emulator.snapshot().requests == 0


def test_clients_follow_the_session_environment(gcs_emulator, gs_example):
    """tensorstore, gcsfs (via epath) and a child process all reach the emulator via the proxy."""
    env = gcs_emulator.env()
    front = gcs_emulator.front_url
    assert front != gcs_emulator.direct_url
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == env["TENSORSTORE_GCS_HTTP_URL"] == front
    assert os.environ["STORAGE_EMULATOR_HOST"] == front
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in os.environ

    run, maxtext = gs_example
    with gcs_emulator.measure() as c:
        assert (run / TUNIX_STEP / "model_params").is_dir()  # gcsfs
    assert c.requests > 0
    with gcs_emulator.measure() as c:
        oml.read_specs(maxtext / "items")  # tensorstore (and gcsfs)
    assert c.media_bytes_down > 0
    code = "from etils import epath; import sys; print(epath.Path(sys.argv[1]).read_text())"
    with gcs_emulator.measure() as c:
        out = subprocess.run(
            [sys.executable, "-c", code, str(maxtext / "commit_success.txt")],
            env=gcs_emulator.subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == (MAXTEXT_STEP / "commit_success.txt").read_text()
    assert c.media_bytes_down > 0


# ---- what works on gs:// today ---------------------------------------------------------------


def _rel(path, root) -> str:
    return str(path).removeprefix(str(root)).lstrip("/")


def test_find_steps_and_detect_layout(gs_example):
    run, maxtext = gs_example
    local = [
        (i.role, i.step, i.layout, _rel(i.path, TUNIX_RUN / "checkpoints"))
        for i in oml.find_steps(TUNIX_RUN / "checkpoints")
    ]
    remote = [
        (i.role, i.step, i.layout, _rel(i.path, run / "checkpoints"))
        for i in oml.find_steps(run / "checkpoints")
    ]
    assert remote == local == [("actor", 2, oml.Layout.TUNIX, "actor/2")]
    assert oml.find_steps(maxtext.parent) == [oml.StepInfo(maxtext, 2, oml.Layout.MAXTEXT, None)]

    for gs, loc in [
        (run / TUNIX_STEP, TUNIX_RUN / TUNIX_STEP),
        (maxtext, MAXTEXT_STEP),
        (run / "checkpoints", TUNIX_RUN / "checkpoints"),
        (run / "no-such-step", TUNIX_RUN / "no-such-step"),
    ]:
        assert oml.detect_layout(gs) is oml.detect_layout(loc), gs
    assert oml.detect_layout(run / TUNIX_STEP) is oml.Layout.TUNIX
    assert oml.detect_layout(maxtext) is oml.Layout.MAXTEXT


def test_read_specs_and_target_from_checkpoint(gs_example):
    run, maxtext = gs_example
    for item in ("model_params", "optimizer_state"):
        assert oml.read_specs(run / TUNIX_STEP / item) == oml.read_specs(
            TUNIX_RUN / TUNIX_STEP / item
        )
    remote, local = oml.Target.from_checkpoint(maxtext), oml.Target.from_checkpoint(MAXTEXT_STEP)
    assert remote.params == local.params
    assert remote.nnx_aux == local.nnx_aux
    assert remote.opt_state == local.opt_state
    assert remote.intermediates == local.intermediates
    assert remote.abstract == local.abstract


def test_dry_run_report_equals_local(gs_example, gcs_emulator):
    run, maxtext = gs_example
    step = run / TUNIX_STEP
    before = gcs_emulator.list(_rel(step, f"gs://{gcs_emulator.bucket}"))
    with gcs_emulator.measure() as c:
        remote = oml.convert_step(step, oml.Target.from_checkpoint(maxtext), dry_run=True)
    local = oml.convert_step(
        TUNIX_RUN / TUNIX_STEP, oml.Target.from_checkpoint(MAXTEXT_STEP), dry_run=True
    )
    assert remote.status == "dry-run"
    r, lo = remote.to_dict(), local.to_dict()
    assert r.pop("step_dir") == str(step)
    assert lo.pop("step_dir") == str(TUNIX_RUN / TUNIX_STEP)
    assert r == lo
    assert c.media_bytes_up == 0 and c.by_kind.get("upload", 0) == 0, c  # writes nothing
    assert gcs_emulator.list(_rel(step, f"gs://{gcs_emulator.bucket}")) == before


@pytest.mark.parametrize("form", ["model_params", "step", "maxtext_items"])
def test_load_params_from_path_bit_equal(gs_example, form):
    run, maxtext = gs_example
    remote, local = {
        "model_params": (
            run / TUNIX_STEP / "model_params",
            TUNIX_RUN / TUNIX_STEP / "model_params",
        ),
        "step": (run / TUNIX_STEP, TUNIX_RUN / TUNIX_STEP),
        "maxtext_items": (maxtext / "items", MAXTEXT_STEP / "items"),
    }[form]
    abstract = _abstract_params()
    got = oml.load_params_from_path(remote, abstract)
    want = oml.load_params_from_path(local, abstract)
    assert_bit_equal(got, want)
    assert _flat(got)  # not empty


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
@pytest.mark.parametrize(
    "item", ["actor/2/model_params", "actor/2/optimizer_state", "maxtext/items"]
)
def test_stock_orbax_restore_bit_equal(gs_example, item):
    run, maxtext = gs_example
    if item.startswith("maxtext/"):
        remote, local = maxtext / "items", MAXTEXT_STEP / "items"
    else:
        remote = run / "checkpoints" / item
        local = TUNIX_RUN / "checkpoints" / item
    # Each leaf placed on the default device, not where the step's _sharding says.
    got = stock_restore(remote)
    want = stock_restore(local)
    assert_bit_equal(got, want)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_stock_orbax_save_restore_counts_bytes(gcs_emulator, gs_prefix):
    """Stock Orbax save and restore through the proxy: the baseline issue 12 compares with."""
    rng = np.random.default_rng(1)
    tree = {
        "w": rng.standard_normal((512, 1024), dtype=np.float32),
        "b": np.arange(4096, dtype=np.int32),
        "key": jax.random.key(7),
    }
    item = gs_prefix.path("stock/1/items")
    with gcs_emulator.measure() as up:
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(item, args=ocp.args.PyTreeSave(tree))
    objects = gs_prefix.objects("stock/1/items")
    data = sum(v for k, v in objects.items() if "/d/" in f"/{k}")
    assert up.media_bytes_up >= sum(objects.values()), (up, objects)
    assert data >= 0.9 * (tree["w"].nbytes + tree["b"].nbytes), objects
    with gcs_emulator.measure() as down:
        back = ocp.PyTreeCheckpointHandler().restore(item)
    assert_bit_equal(back, tree)
    # OCDBT reads byte ranges of the data files: about their size, never much more.
    assert 0.99 * data <= down.media_bytes_down <= sum(objects.values()) + (64 << 10), down
    assert down.media_bytes_up == 0, down


def _cli(args, env) -> subprocess.CompletedProcess:
    """The command with the environment ``env`` (a whole one: `subprocess_env`), forked from
    a warm interpreter (`forked_cli.run_cli`; the emulator's variables are read by the
    command's own GCS clients, not when Python starts)."""
    keys = set(env) | set(os.environ)
    changes = {k: env.get(k) for k in keys if env.get(k) != os.environ.get(k)}
    return run_cli(*args, env=changes, cwd=os.getcwd(), timeout=600)


def test_cli_inspect(gcs_emulator, gs_example):
    run, maxtext = gs_example
    env = gcs_emulator.subprocess_env()
    remote = _cli(
        ["inspect", str(run / "checkpoints"), "--target-from", str(maxtext), "--json"], env
    )
    assert remote.returncode == 0, remote.stderr
    local = _cli(
        ["inspect", str(TUNIX_RUN / "checkpoints"), "--target-from", str(MAXTEXT_STEP), "--json"],
        env,
    )
    assert local.returncode == 0, local.stderr
    r = remote.stdout.replace(str(run), "<RUN>")
    lo = local.stdout.replace(str(TUNIX_RUN), "<RUN>")
    assert json.loads(r) == json.loads(lo)
    assert json.loads(r)[0]["path"] == f"<RUN>/{TUNIX_STEP}"
    assert "plan" in json.loads(r)[0]

    text = _cli(["inspect", str(run / TUNIX_STEP)], env)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"{run / TUNIX_STEP}: step 2 tunix role=actor"), text.stdout


# ---- writes on gs:// (issue 12) --------------------------------------------------------------


def _convert_kwargs(mode: str, gs_prefix) -> dict:
    return {"default": {}, "in_place": {"in_place": True}, "out": {"out": gs_prefix.path("out/2")}}[
        mode
    ]


@pytest.mark.parametrize("mode", ["default", "out"])
def test_convert_on_gs_never_modifies_legacy_items(gs_example, gs_prefix, tmp_path, mode):
    """A conversion (without --in-place) leaves the source's legacy items bit-equal."""
    run, maxtext = gs_example
    report = oml.convert_step(
        run / TUNIX_STEP, oml.Target.from_checkpoint(maxtext), **_convert_kwargs(mode, gs_prefix)
    )
    assert report.status == "converted"
    step_rel = f"tunix_rl_run/{TUNIX_STEP}"
    names = {"model_params", "optimizer_state"}
    if mode == "out":
        names |= {"_CHECKPOINT_METADATA", "commit_success.txt"}
    for name in sorted(names):
        rel = f"{step_rel}/{name}"
        if (TUNIX_RUN / TUNIX_STEP / name).is_file():
            got = gs_prefix.emu.get_bytes(f"{gs_prefix.prefix}/{rel}")
            assert got == (TUNIX_RUN / TUNIX_STEP / name).read_bytes(), name
        else:
            back = gs_prefix.download(rel, tmp_path / name)
            assert _digest(back) == _digest(TUNIX_RUN / TUNIX_STEP / name), name


# ---- restores from gs://: the restore engine, the metadata read once (issue 58) -------------

_PARAMS = {  # a small MaxText-like params tree: 2-D and 3-D (scanned) arrays, a vector
    ("token_embedder", "embedding"): (256, 64),
    ("decoder", "layers", "mlp", "kernel"): (64, 4, 128),
    ("decoder", "decoder_norm", "scale"): (64,),
}


def _save_steps(root: Path, chunks: int) -> dict[str, Path]:
    """The same params saved by stock Orbax as a MaxText step (``items/params/...``) and as a
    Tunix step (``model_params/...``, a ``value`` level per leaf), ``chunks`` chunks per
    array."""
    rng = np.random.default_rng(chunks)
    flat = {p: rng.standard_normal(s, dtype=np.float32) for p, s in _PARAMS.items()}
    sargs = {p: ocp.SaveArgs(chunk_byte_size=max(1, x.nbytes // chunks)) for p, x in flat.items()}
    steps = {"maxtext": root / "maxtext" / "0", "tunix": root / "tunix" / "0"}
    items = {
        "maxtext": (
            "items",
            {"params": {"params": _nest(flat)}},
            {"params": {"params": _nest(sargs)}},
        ),
        "tunix": (
            "model_params",
            _nest({(*p, "value"): x for p, x in flat.items()}),
            _nest({(*p, "value"): a for p, a in sargs.items()}),
        ),
    }
    for layout, (item, tree, save_args) in items.items():
        with ocp.CheckpointManager(
            steps[layout].parent,
            item_handlers={item: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        ) as mngr:
            mngr.save(
                0, args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree, save_args=save_args)})
            )
    return steps


def _params_abstract():
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(jax.devices()[0])
    return _nest(
        {
            ("params", *p): jax.ShapeDtypeStruct(s, np.float32, sharding=sharding)
            for p, s in _PARAMS.items()
        }
    )


def _stock_params(items_dir, abstract):
    """MaxText 0.2.5's ``load_params_from_path`` call with stock Orbax (the oracle)."""
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)) as ckptr:
        return ckptr.restore(
            items_dir,
            item={"params": abstract},
            transforms={},
            restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract)},
        )["params"]


@pytest.fixture(scope="module")
def saved_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs-restore")
    return {c: _save_steps(root / f"chunks{c}", c) for c in (1, 8)}


@pytest.mark.parametrize("chunks", [1, 8])
def test_restore_from_gs_bit_identical_through_the_engine(
    gcs_emulator, gs_prefix, saved_steps, chunks
):
    """`load_params_from_path` of a MaxText and a Tunix step on gs://: what stock Orbax restores
    from the same objects, bit for bit; every stored chunk decoded by the restore engine
    (none left to stock); no more requests than stock's plus the item's metadata files."""
    steps = {
        k: gs_prefix.upload(p.parent, f"{k}/{chunks}") / "0" for k, p in saved_steps[chunks].items()
    }
    abstract = _params_abstract()
    with gcs_emulator.measure() as stock_counts:
        want = _stock_params(steps["maxtext"] / "items", abstract)
    for layout, item in (("maxtext", "items"), ("tunix", "model_params")):
        invalidate_gcsfs_caches()
        with gcs_emulator.measure() as c, io_counts() as io:
            got = oml.load_params_from_path(steps[layout] / item, abstract)
        assert_bit_equal(got, want)
        decoded = sum(n for (kind, _), n in io.items() if kind == "chunk decoded")
        assert decoded >= len(_PARAMS) * (1 if chunks == 1 else 4), (layout, io)
        assert sum(n for (kind, _), n in io.items() if kind == "item files") == 1, (layout, io)
        # _METADATA, _sharding, array_metadatas/process_0, manifest.ocdbt and a B-tree node
        assert c.requests <= stock_counts.requests + 5, (layout, c, stock_counts)
        assert c.media_bytes_down <= stock_counts.media_bytes_down * 1.1, (layout, c, stock_counts)


def test_restore_from_gs_names_a_truncated_data_file(gs_prefix, saved_steps):
    """A data file cut short on gs:// (a copy still landing, a step being deleted): a
    `CheckpointReadError` naming it, not garbage and not a crash."""
    steps = {k: gs_prefix.upload(p.parent, f"{k}/cut") / "0" for k, p in saved_steps[1].items()}
    for layout, item in (("maxtext", "items"), ("tunix", "model_params")):
        local = saved_steps[1][layout] / item / "ocdbt.process_0" / "d"
        biggest = max(local.iterdir(), key=lambda f: f.stat().st_size)
        remote = steps[layout] / item / "ocdbt.process_0" / "d" / biggest.name
        remote.write_bytes(biggest.read_bytes()[:100])
        invalidate_gcsfs_caches()
        with pytest.raises(oml.CheckpointReadError, match=biggest.name):
            oml.load_params_from_path(steps[layout] / item, _params_abstract())


def test_an_empty_json_file_reads_as_on_disk(gs_prefix, tmp_path):
    """An empty ``_sharding`` (0 bytes: the store refuses any range of it) is read as empty
    on gs:// too, and refused as on a disk, not raised as the client's HTTP error."""
    import shutil

    local = tmp_path / "2"
    shutil.copytree(MAXTEXT_STEP, local)
    (local / "items" / "_sharding").write_bytes(b"")
    remote = gs_prefix.upload(local, "empty/2")
    from orbax_maxtext_layout.orbax_io.orbax_files import ItemFiles, reads_only

    for step in (local, remote):
        for read in (ItemFiles.read, reads_only(ItemFiles.read)):  # asked, and read ahead
            with pytest.raises(oml.CheckpointReadError, match="_sharding: invalid JSON"):
                read(step / "items")
