"""Chunks tensorstore left unwritten because they equal the fill value restore as stock
restores them (issue 58).

Older Orbax wrote no ``store_array_data_equal_to_fill_value`` in ``_METADATA``, and
tensorstore then leaves a chunk that equals the fill value (an all-zero one) unwritten;
stock Orbax reads such a step with ``fill_missing_data_reads`` and returns the fill value.
Each step here is written by stock Orbax (zarr2 and Orbax's sharded zarr3 over OCDBT, zarr2
without OCDBT) and made what older Orbax wrote: its all-zero chunks' keys removed through
tensorstore's kvstore and the flag dropped from ``_METADATA``. The library's restore (the
engine) and its chunk reader must give stock's bytes (hashed), for host and device targets,
with a cast, and with a fill value other than zero; with the flag true a missing chunk is
still refused, as stock refuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath

from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.execute.restore import restore_pytree
from orbax_maxtext_layout.orbax_io import item_writer
from orbax_maxtext_layout.orbax_io.reader import ItemReader

LOGGER = "orbax_maxtext_layout.execute.restore"
HOST = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
FORMATS = {
    "zarr2": {"use_zarr3": False},
    "zarr3": {"use_zarr3": True},
    "zarr2-no-ocdbt": {"use_zarr3": False, "use_ocdbt": False},
}


def _tree() -> dict:
    """``w``: 8 chunks of 125 columns (``chunk_byte_size``), the 2nd and the last all zero;
    ``z``: one chunk, all zero; ``b``: one chunk of values."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 1000)).astype(np.float32)
    w[:, 125:250] = 0
    w[:, 875:] = 0
    return {
        "w": w,
        "z": np.zeros((30, 40), np.float32),
        "b": rng.standard_normal((30, 40)).astype(np.float32),
    }


def _kv(item: Path, ocdbt: bool) -> ts.KvStore:
    base = f"file://{item}/"
    return ts.KvStore.open({"driver": "ocdbt", "base": base} if ocdbt else base).result()


def _as_older_orbax(item: Path, fmt: str) -> list[str]:
    """Removes the item's all-zero chunks (as tensorstore leaves them unwritten without
    ``store_data_equal_to_fill_value``) and the flag from ``_METADATA``; returns the keys."""
    ocdbt = FORMATS[fmt].get("use_ocdbt", True)
    kv = _kv(item, ocdbt)
    zero = {"w": [1, 7], "z": [0]}  # column chunks of `w`, and `z`'s one chunk
    keys = []
    for name, cells in zero.items():
        for i in cells:
            key = f"{name}/c/0/{i}" if fmt == "zarr3" else f"{name}/0.{i}"
            assert kv.read(key).result().state == "value", key
            kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
            keys.append(key)
    meta = json.loads((item / "_METADATA").read_text())
    del meta["store_array_data_equal_to_fill_value"]
    (item / "_METADATA").write_text(json.dumps(meta))
    return keys


@pytest.fixture(scope="module", params=list(FORMATS))
def saved(tmp_path_factory, request) -> tuple[Path, str, dict]:
    """A stock step of `_tree`, as written (the flag true, every chunk stored)."""
    fmt = request.param
    path = Path(tmp_path_factory.mktemp("fill")) / "item"
    tree = _tree()
    save_args = {k: ocp.SaveArgs() for k in tree}
    save_args["w"] = ocp.SaveArgs(chunk_byte_size=32_000)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**FORMATS[fmt]))
    ckptr.save(epath.Path(path), args=ocp.args.PyTreeSave(tree, save_args=save_args))
    ckptr.close()
    return path, fmt, tree


@pytest.fixture
def older(saved, tmp_path) -> tuple[Path, str, dict]:
    path, fmt, tree = saved
    item = tmp_path / "older"
    shutil.copytree(path, item)
    _as_older_orbax(item, fmt)
    return item, fmt, tree


def _stock(path, args):
    return ocp.PyTreeCheckpointHandler().restore(path, args=args)


def _args(tree: dict, dtype=None) -> ocp.args.PyTreeRestore:
    rargs = {
        "w": ocp.ArrayRestoreArgs(sharding=HOST, global_shape=tree["w"].shape, dtype=dtype),
        "z": ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype),
        "b": ocp.ArrayRestoreArgs(sharding=HOST, global_shape=tree["b"].shape, dtype=dtype),
    }
    return ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)


def _digest(tree: dict) -> dict[str, str]:
    return {
        k: f"{np.asarray(v).dtype}:{hashlib.sha256(np.asarray(v).tobytes()).hexdigest()}"
        for k, v in tree.items()
    }


def _engine_count(caplog) -> int:
    pattern = r": (\d+) arrays .* read by the restore engine"
    return sum(int(m.group(1)) for r in caplog.records if (m := re.search(pattern, r.getMessage())))


@pytest.mark.parametrize("dtype", [None, np.float16], ids=["stored", "cast"])
def test_unwritten_fill_value_chunks_restore_as_stock(older, dtype, caplog):
    item, _, tree = older
    args = _args(tree, dtype)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(epath.Path(item), args, _stock)
    assert _engine_count(caplog) == 3
    want = _stock(epath.Path(item), args)
    assert _digest(got) == _digest(want)
    if dtype is None:
        assert _digest(got) == _digest(tree)  # the zero chunks are zeros again


def test_the_chunk_reader_fills_as_stock(older):
    """`read_whole` and `pieces` (what convert and export read through) fill too."""
    item, _, tree = older
    src = ItemReader.open(epath.Path(item), item_writer.ts_context())
    for name, value in tree.items():
        np.testing.assert_array_equal(src.read_whole(name), value)
        out = np.full(value.shape, np.nan, value.dtype)
        for p in src.pieces(name, max_bytes=4096):
            out[p.box] = p.data
        assert out.tobytes() == value.tobytes()


def test_the_metadata_fill_value_is_read_as_tensorstore_reads_it(older, tmp_path, caplog):
    """A fill value other than zero in the zarr metadata (zarr3's "NaN", zarr2's -2.5):
    the unwritten chunks hold it, bit for bit as stock gives it."""
    item, fmt, tree = older
    key = "w/zarr.json" if fmt == "zarr3" else "w/.zarray"
    kv = _kv(item, FORMATS[fmt].get("use_ocdbt", True))
    meta = json.loads(bytes(kv.read(key).result().value))
    meta["fill_value"] = "NaN" if fmt == "zarr3" else -2.5
    kv.write(key, json.dumps(meta).encode()).result()
    args = _args(tree)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(epath.Path(item), args, _stock)
    assert _engine_count(caplog) == 3
    want = _stock(epath.Path(item), args)
    assert _digest(got) == _digest(want)
    w = np.asarray(got["w"])
    assert np.isnan(w[:, 125:250]).all() if fmt == "zarr3" else (w[:, 125:250] == -2.5).all()


def test_a_missing_chunk_of_a_step_that_stores_every_chunk_is_refused(saved, tmp_path):
    """With ``store_array_data_equal_to_fill_value`` true (Orbax 0.12), a missing chunk is
    damage: stock raises, and so does the library, naming the array and the chunk."""
    path, fmt, tree = saved
    item = tmp_path / "damaged"
    shutil.copytree(path, item)
    kv = _kv(item, FORMATS[fmt].get("use_ocdbt", True))
    key = "w/c/0/1" if fmt == "zarr3" else "w/0.1"
    kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    args = _args(tree)
    with pytest.raises(Exception, match="missing"):
        _stock(epath.Path(item), args)
    with pytest.raises(CheckpointReadError, match=r"cannot read w: (chunk|shard) .* not stored"):
        restore_pytree(epath.Path(item), args, _stock)


def test_a_shards_unwritten_inner_chunks_restore_as_stock(saved, tmp_path, caplog):
    """A zarr3 shard of several inner chunks, written by tensorstore without
    ``store_data_equal_to_fill_value`` (its default): the all-zero inner chunks are left out
    of the shard (their index entries say "missing"), and a shard all zero is not written."""
    path, fmt, tree = saved
    if fmt != "zarr3":
        pytest.skip("zarr3 shards")
    item = tmp_path / "inner"
    shutil.copytree(path, item)
    meta = json.loads(bytes(_kv(item, True).read("w/zarr.json").result().value))
    shard = meta["codecs"][0]["configuration"]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [64, 500]  # 2 shards
    shard["chunk_shape"] = [64, 125]  # of 4 inner chunks each
    kvspec = {"driver": "ocdbt", "base": f"file://{item}/", "path": "w/"}
    w = ts.open(
        {"driver": "zarr3", "kvstore": kvspec, "metadata": meta},
        create=True,
        delete_existing=True,
    ).result()
    value = tree["w"].copy()
    value[:, 500:] = 0  # the second shard: all zero, never written
    w.write(value).result()
    kv = _kv(item, True)
    assert kv.read("w/c/0/1").result().state == "missing"
    doc = json.loads((item / "_METADATA").read_text())
    del doc["store_array_data_equal_to_fill_value"]
    (item / "_METADATA").write_text(json.dumps(doc))
    args = _args(tree)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(epath.Path(item), args, _stock)
    assert _engine_count(caplog) == 3
    want = _stock(epath.Path(item), args)
    assert _digest(got) == _digest(want)
    assert np.asarray(got["w"]).tobytes() == value.tobytes()
    src = ItemReader.open(epath.Path(item), item_writer.ts_context())
    assert src.read_whole("w").tobytes() == value.tobytes()


def _zero_arrays_unwritten(item: Path) -> list[str]:
    """Makes ``item`` (zarr2 over OCDBT) what older Orbax wrote: every all-zero array's
    chunk keys removed and the flag dropped from ``_METADATA``; returns the arrays."""
    kv = _kv(item, True)
    names = sorted({k.decode().rsplit("/", 1)[0] for k in kv.list().result() if b".zarray" in k})
    gone = []
    for name in names:
        arr = ts.open(
            {
                "driver": "zarr",
                "kvstore": {"driver": "ocdbt", "base": f"file://{item}/", "path": f"{name}/"},
            }
        ).result()
        if arr.dtype.numpy_dtype.kind == "V" or np.any(arr.read().result()):
            continue
        for key in kv.list(ts.KvStore.KeyRange(f"{name}/", f"{name}/\xff")).result():
            if not key.endswith(b".zarray"):
                kv.delete_range(ts.KvStore.KeyRange(key.decode(), key.decode() + "\0")).result()
        gone.append(name)
    meta = json.loads((item / "_METADATA").read_text())
    del meta["store_array_data_equal_to_fill_value"]
    (item / "_METADATA").write_text(json.dumps(meta))
    return gone


def test_convert_writes_an_older_steps_unwritten_chunks_as_stock_reads_them(tmp_path):
    """A Tunix step from older Orbax (an untrained optimizer's zero moments and RNG counts
    left unwritten) converts: the arrays lacking chunks are decoded, filled as stock reads
    them, and the written step, which stores every chunk, equals the one converted from the
    same step as Orbax 0.12 writes it (no "chunks stored" refusal: issue 58's 0 false
    refusals, for convert too)."""
    import writers as W
    from conftest import stock_restore

    from orbax_maxtext_layout import Target, convert_step
    from orbax_maxtext_layout.base.treepaths import flatten

    model = W.make_model(scanned=True)
    step = W.write_tunix_step(tmp_path / "run", 1, model, W.make_optimizer(model, "sft"))
    older = tmp_path / "older" / "1"
    shutil.copytree(step, older)
    gone = {i: _zero_arrays_unwritten(older / i) for i in ("model_params", "optimizer_state")}
    assert len(gone["optimizer_state"]) > 4 and gone["model_params"], gone  # moments, counts
    target = Target.from_nnx(W.abstract_model(scanned=True))
    for s in (step, older):
        convert_step(epath.Path(s), target)

    def raw(v):
        return jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v

    want = {p: raw(v) for p, v in flatten(stock_restore(step / "items")).items()}
    got = {p: raw(v) for p, v in flatten(stock_restore(older / "items")).items()}
    assert _digest(got) == _digest(want) and len(got) == len(want)
    stored = json.loads((older / "items" / "_METADATA").read_text())
    assert stored["store_array_data_equal_to_fill_value"] is True
