"""The restore engine casts as stock Orbax casts, bit for bit, over the whole dtype matrix.

One real Orbax step per format (zarr2 and zarr3 over OCDBT, zarr2 without OCDBT) holds one
array per stored dtype, each full of the values casts disagree on: NaN with payloads
(quiet and signalling, both signs), +-Inf, -0, subnormals, each dtype's max and min, values
out of every integer range, and values that round differently through float32 (issue 58:
1+2**-8+2**-30 to bfloat16). Each requested dtype restores every array once through the
library (`restore_pytree`, the engine counted in its debug line) and once through stock
`PyTreeCheckpointHandler`, half the arrays as host ``np.ndarray``s and half as CPU
``jax.Array``s, and the bits (viewed as unsigned integers) must be equal.
"""

from __future__ import annotations

import logging
import re
import warnings

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath

from orbax_maxtext_layout.execute.restore import restore_pytree

LOGGER = "orbax_maxtext_layout.execute.restore"
HOST = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

DTYPES = [
    np.dtype(d)
    for d in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
]

# Values that casts disagree on, as float64; each dtype's own specials are added below.
_WIDE = [0.0, -0.0, 1.0, -1.0, 0.1, 1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40, 127.5, -128.5]
_WIDE += [255.9, 256.0, -129.0, 300.0, -300.0, 65504.0, 65520.0, 70000.0, -70000.0, 3e9]
_WIDE += [-3e9, 2.0**31, -(2.0**31) - 1, 2.0**32, 1e19, -1e19, 2.0**63, 2.0**64, 1e39, 1e300]
_WIDE += [-1e300, 5e-324, 1e-40, 1e-45, 6e-8, 1e-10, np.inf, -np.inf, np.nan, -np.nan]

# NaN payloads (quiet and signalling, both signs), by the bits of each float dtype.
_NANS = {
    np.dtype(np.float16): [0x7E01, 0x7D00, 0xFE55, 0x7C01],
    np.dtype(ml_dtypes.bfloat16): [0x7FE0, 0x7FA0, 0xFFC1, 0x7F81],
    np.dtype(np.float32): [0x7FC00001, 0x7FA00000, 0xFFC12345, 0x7F800001, 0x7FFFE000],
    np.dtype(np.float64): [0x7FF8000000000001, 0x7FF4000000000000, 0xFFF8000012345678],
}
_NANS[np.dtype(np.float64)].append(0x7FFFFC0000000000)  # a payload float32 keeps
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _values(dtype: np.dtype) -> np.ndarray:
    """The special values of ``dtype``: the wide list cast to it, and its own extremes."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype.kind == "b":
            return np.array([False, True, True, False], dtype)
        out = [np.array(_WIDE).astype(dtype)]
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            out.append(np.array([info.min, info.max, info.min + 1, info.max - 1, 0], dtype))
        elif dtype.kind == "c":
            part = np.array(_WIDE)
            out.append((part + 1j * part[::-1]).astype(dtype))
        else:
            info = ml_dtypes.finfo(dtype)
            extremes = [info.max, info.min, info.tiny, info.smallest_subnormal, info.eps]
            out.append(np.array(extremes, dtype))
            out.append(-np.array(extremes[2:], dtype))
            out.append(np.array(_NANS[dtype], _UINT[dtype.itemsize]).view(dtype))
        return np.concatenate(out)


def _bits(x) -> bytes:
    x = np.asarray(x)
    return x.view(_UINT.get(x.dtype.itemsize, np.uint8)).tobytes()


def _tree() -> dict:
    """Every dtype's values twice (one to restore on the host, one on a device), 3 rows so
    that a chunk-size limit cuts them into several chunks."""
    tree = {}
    for dt in DTYPES:
        v = np.tile(_values(dt), (3, 1))
        tree[f"host_{dt.name}"] = v
        tree[f"dev_{dt.name}"] = v[::-1].copy()
    return tree


FORMATS = {
    "zarr2": {"use_zarr3": False},
    "zarr3": {"use_zarr3": True},
    "zarr2-no-ocdbt": {"use_zarr3": False, "use_ocdbt": False},
}


@pytest.fixture(scope="module", params=list(FORMATS))
def step(tmp_path_factory, request):
    path = epath.Path(tmp_path_factory.mktemp("casts")) / "item"
    tree = _tree()
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=256), tree)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**FORMATS[request.param]))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    ckptr.close()
    return path, tree


def _casts(stored: np.dtype, requested: np.dtype) -> bool:
    """Whether tensorstore's cast driver, the one stock reads through, takes the pair."""
    try:
        ts.cast(ts.array(np.zeros((), stored)), requested).read().result()
    except (ValueError, TypeError):
        return False
    return True


def _stock(path, args):
    return ocp.PyTreeCheckpointHandler().restore(path, args=args)


def _engine_count(caplog) -> int:
    pattern = r": (\d+) arrays .* read by the restore engine"
    return sum(int(m.group(1)) for r in caplog.records if (m := re.search(pattern, r.getMessage())))


@pytest.mark.parametrize("requested", DTYPES, ids=[d.name for d in DTYPES])
def test_every_stored_dtype_casts_as_stock(step, requested, caplog):
    path, tree = step
    rargs = {}
    for key, value in tree.items():
        if not _casts(value.dtype, requested):
            continue  # complex to bool: stock refuses it too (below)
        if key.startswith("host_"):
            rargs[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=requested)
        else:
            rargs[key] = ocp.ArrayRestoreArgs(
                sharding=HOST, global_shape=value.shape, dtype=requested
            )
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs, partial_restore=True)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    assert _engine_count(caplog) == len(rargs)  # every array through the engine
    want = _stock(path, args)
    assert set(got) == set(want) == set(rargs)
    wrong = []
    for key in rargs:
        g, w = got[key], want[key]
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array))
        assert np.asarray(g).dtype == np.asarray(w).dtype  # jax: 64 bits to 32 without x64
        if _bits(g) != _bits(w):
            wrong.append(f"{tree[key].dtype} -> {requested} ({key})")
    assert not wrong, wrong


def test_a_cast_tensorstore_refuses_goes_the_stock_way(step):
    path, tree = step
    key = "dev_complex64"
    assert not _casts(tree[key].dtype, np.dtype(np.bool_))
    rargs = {key: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=tree[key].shape, dtype=bool)}
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs, partial_restore=True)
    with pytest.raises(Exception) as stock:
        _stock(path, args)
    with pytest.raises(Exception) as ours:
        restore_pytree(path, args, _stock)
    assert type(ours.value) is type(stock.value)
