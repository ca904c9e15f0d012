"""The test encoder of OCDBT leaf nodes (`ocdbt_craft`), proved against tensorstore and stock
Orbax: an item re-encoded with its own table restores equal; so does one whose data files were
moved elsewhere inside the item, or whose inline values were moved out to a data file; a tree
of many nodes flattened into one leaf reads the same; and a table written with odd paths is
decoded by tensorstore as written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import ocdbt_craft as C
import pytest
import tensorstore as ts
from conftest import FIXTURES, copy_fixture, raw, restore_flat

ITEMS = {
    "tunix017_rl_params": "tunix017/rl_run/checkpoints/actor/2/model_params",
    "tunix017_rl_optimizer": "tunix017/rl_run/checkpoints/actor/2/optimizer_state",
    "maxtext_native": "maxtext_native/run/checkpoints/2/items",
    "v1_zarr3": "tunix_snapshot_v1/rl_run/checkpoints/actor/2/model_params",
    "gemma3_lora": "maxtext025/gemma3_lora_run/checkpoints/2/model_params",
}


def _item(tmp_path: Path, rel: str) -> Path:
    """A writable copy of the fixture item ``rel`` (its step copied whole)."""
    step_rel, item = rel.rsplit("/", 1)
    return copy_fixture(step_rel, tmp_path).resolve() / item


def _assert_restores_equal(item: Path, rel: str) -> None:
    want = restore_flat((FIXTURES / rel).resolve())
    got = restore_flat(item)
    assert got.keys() == want.keys()
    for k, v in want.items():
        a, b = raw(v), raw(got[k])
        assert a.dtype == b.dtype and np.array_equal(a, b), k


def test_crc32c_and_varints():
    assert C.crc32c(b"") == 0
    assert C.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert C.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, B.4
    assert [C.varint(n) for n in (0, 1, 127, 128, 300, 2**32)] == [
        b"\x00",
        b"\x01",
        b"\x7f",
        b"\x80\x01",
        b"\xac\x02",
        b"\x80\x80\x80\x80\x10",
    ]


@pytest.mark.parametrize("name", ITEMS)
def test_reencoding_unchanged_restores_equal(tmp_path, name):
    item = _item(tmp_path, ITEMS[name])
    entries = C.leaf_entries(item)
    node = C.write_tree(item, entries)
    root = C.dump_manifest(item)["versions"][-1]["root"]["location"]
    assert root == f"btreenode::{node}:0:{(item / node).stat().st_size}"
    assert C.leaf_entries(item) == entries  # tensorstore decodes what was encoded
    assert (item / node).read_bytes()[:4] == C.BTREE_NODE_MAGIC.to_bytes(4, "big")
    assert (item / "manifest.ocdbt").read_bytes()[:4] == C.MANIFEST_MAGIC.to_bytes(4, "big")
    _assert_restores_equal(item, ITEMS[name])


@pytest.mark.parametrize("name", ["tunix017_rl_params", "maxtext_native", "v1_zarr3"])
def test_data_files_moved_inside_the_item_restore_equal(tmp_path, name):
    """Every data file moved from ``[ocdbt.process_0/]d/<hex>`` to ``e/<hex>`` and the table
    pointed there: stock Orbax reads the new places (the old ones are gone)."""
    item = _item(tmp_path, ITEMS[name])
    files = C.data_files(C.leaf_entries(item))
    assert files
    for base, rel in files:
        (item / "e").mkdir(exist_ok=True)
        os.replace(item / (base + rel), item / "e" / Path(rel).name)
    C.retable(item, lambda base, rel: ("", "e/" + Path(rel).name))
    assert {f for f in C.data_files(C.leaf_entries(item))} == {
        ("", "e/" + Path(r).name) for _, r in files
    }
    _assert_restores_equal(item, ITEMS[name])


def test_a_base_path_and_a_relative_path_join(tmp_path):
    """The table's two halves are concatenated: ``("e/", "<hex>")`` names ``e/<hex>``."""
    rel = ITEMS["tunix017_rl_params"]
    item = _item(tmp_path, rel)
    for base, r in C.data_files(C.leaf_entries(item)):
        (item / "e").mkdir(exist_ok=True)
        os.replace(item / (base + r), item / "e" / Path(r).name)
    C.retable(item, lambda base, r: ("e/", Path(r).name))
    assert {b for b, _ in C.data_files(C.leaf_entries(item))} == {"e/"}
    _assert_restores_equal(item, rel)


def test_externalized_values_restore_equal(tmp_path):
    """The LoRA step's values all lie inline; moved out to one data file, they read the same."""
    rel = "tunix017/sft_lora_run/checkpoints/1/model_params"
    item = _item(tmp_path, rel)
    assert not C.data_files(C.leaf_entries(item))
    entries = C.externalize(item, lambda e: not e.key.endswith(b".zarray"))
    assert [e for e in entries if e.inline is None]
    assert all(e.inline is not None for e in entries if e.key.endswith(b".zarray"))
    assert len(C.data_files(C.leaf_entries(item))) == 1
    _assert_restores_equal(item, rel)


def test_a_tree_of_many_nodes_is_flattened_into_one_leaf(tmp_path):
    """A database tensorstore wrote with small nodes (height > 0): its entries, gathered from
    every leaf and written as one leaf node, read back the same through tensorstore."""
    db = tmp_path / "db"
    spec = {
        "driver": "ocdbt",
        "base": f"file://{db}/",
        "config": {"max_decoded_node_bytes": 512, "max_inline_value_bytes": 16},
    }
    kv = ts.KvStore.open(spec).result()
    want = {f"k{i:04d}".encode(): bytes([i % 251]) * (i % 40) for i in range(400)}
    txn = ts.Transaction()
    for k, v in want.items():
        kv.with_transaction(txn)[k] = v
    txn.commit_sync()
    assert C.dump_manifest(db)["versions"][-1]["root_height"] > 0
    entries = C.leaf_entries(db)
    assert [e.key for e in entries] == sorted(want)
    assert any(e.inline is None for e in entries) and any(e.inline is not None for e in entries)
    C.write_tree(db, entries)
    assert C.dump_manifest(db)["versions"][-1]["root_height"] == 0
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
    assert {k: bytes(kv[k]) for k in kv.list().result()} == want


ODD = [
    "d/plain",
    "d/with:colon",
    "d/100%25/literal%",
    "d/sp ace/é",
    "d/nul\0byte",
    "d/not-utf8-\udcff",
    "x" * 3000,
]


def test_odd_paths_are_written_and_decoded_as_given(tmp_path):
    """Any bytes go into the table: tensorstore's dump percent-encodes them (``:`` too), and
    `parse_location` decodes them back."""
    item = _item(tmp_path, ITEMS["tunix017_rl_params"])
    files = C.data_files(C.leaf_entries(item))
    mapping = {
        f: (("b/" if i % 2 else ""), ODD[i % len(ODD)] + f"/{i}") for i, f in enumerate(files)
    }
    C.retable(item, lambda b, r: mapping[b, r])
    assert set(C.data_files(C.leaf_entries(item))) == set(mapping.values())
    base = ts.KvStore.open({"driver": "file", "path": f"{item}/"}).result()
    node = ts.ocdbt.dump(base, C.dump_manifest(item)["versions"][-1]["root"]["location"]).result()
    shown = [e["indirect_value"] for e in node["entries"] if "indirect_value" in e]
    assert any("with%3Acolon" in s for s in shown) and any("nul%00byte" in s for s in shown)
    assert all(s.count(":") == 4 for s in shown)


def test_stock_tensorstore_refuses_a_table_that_leaves_the_item(tmp_path):
    """What issue 46 rests on (HOSTILE.md): the file kvstore refuses a key with a ``..``
    component or an absolute one; the table is not followed."""
    item = _item(tmp_path, ITEMS["tunix017_rl_params"])
    entries = C.leaf_entries(item)
    key = next(e.key for e in entries if e.inline is None)
    outside = tmp_path / "outside"
    shutil.copytree(item / "ocdbt.process_0" / "d", outside / "d")
    for table in [
        lambda b, r: ("", "../../../../outside/" + r),
        lambda b, r: ("", str(outside / r)),
        lambda b, r: (str(outside) + "/", r),
    ]:
        C.write_tree(item, C.remapped(entries, table))
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
        with pytest.raises(ValueError, match="Invalid key"):
            kv[key]
