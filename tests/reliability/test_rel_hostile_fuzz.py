"""Fuzz (hypothesis, seeded) of the data-file paths an OCDBT item names (issue 46).

An item written here by stock Orbax (two arrays past `zarr.SMALL`, which the fast reader
streams from their data file, one read through tensorstore, one inline) has its B-tree
rewritten (`ocdbt_craft`) with random data-file tables: each indirect value's (base path,
relative path) built from ``""``, ``.``, ``..``, ``d``, the item's real file names, ``/``
prefixes, NUL, percent-escapes (which are literal characters in a table), non-UTF-8 bytes,
over-long components and paths, and ``../`` runs that lead to real copies of the data files
planted outside (the bait). A child process (`rel_hostile_child`), under strace where there
is one, then runs `ocdbt.damaged_value_files`, `ItemReader.open` and `chunks.read_whole`
of every array for each table. The rule (the one tensorstore's file kvstore applies to keys):
a path that is empty, absolute, holds NUL, or has an empty, ``.`` or ``..`` component leaves
the item. Then:

- nothing but `CheckpointReadError` escapes, ever;
- a table with a path that leaves: refused at open ("leaves the checkpoint"), each such path
  named so by `damaged_value_files`;
- a table whose paths all stay inside is never refused as leaving; where they name the right
  files, every array reads equal and nothing is damaged;
- no system call names anything outside the item but beside it (the bait's directories), nor
  any outside path a table named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import rel_support as S
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

sys.path.insert(0, str(S.TESTS))
import hostile_support as H  # tests/hostile_support.py
import ocdbt_craft as C  # tests/ocdbt_craft.py
from conftest import child_env  # tests/conftest.py

set_hypothesis_home_dir(S.session_dir() / "hypothesis")

SETTINGS = settings(
    max_examples=S.scale(30, 800),
    deadline=None,
    database=None,  # write nothing outside tests/reliability
    derandomize=not S.FULL,  # CI: the same tables on every machine
    suppress_health_check=list(HealthCheck),
)
LEAVES = "leaves the checkpoint"
MARKER = "/omtl-hostile-fuzz"


def leaves(path: str) -> bool:
    """The rule, written out again here: the spec the library is held to."""
    return (
        not path
        or "\0" in path
        or path.startswith("/")
        or any(part in ("", ".", "..") for part in path.split("/"))
    )


@pytest.fixture
def world(tmp_path) -> Path:
    """``world/a/b/c/items``: an item written by stock Orbax; real copies of its data files
    planted at ``world/{a/b/c,a/b,a,}/d/<hex>`` and ``world/secret.txt`` beside it."""
    import orbax.checkpoint as ocp
    from etils import epath

    world = (tmp_path / "world").resolve()
    rng = np.random.default_rng(S.SEED)
    tree = {
        "params": {
            "params": {
                "big": rng.standard_normal((1024, 512)).astype(np.float32),  # 2 MiB
                "mid": rng.standard_normal((512, 600)).astype(np.float32),  # 1.2 MiB
                "vec": rng.standard_normal(4096).astype(np.float32),  # through tensorstore
                "tiny": np.arange(8, dtype=np.float32),  # inline
            }
        }
    }
    item = world / "a" / "b" / "c" / "items"
    ocp.PyTreeCheckpointer().save(epath.Path(item), tree)
    _one_file_per_value(item)
    for base, rel in C.data_files(C.leaf_entries(item)):
        for up in ("a/b/c", "a/b", "a", "."):
            (world / up / "d").mkdir(parents=True, exist_ok=True)
            shutil.copy(item / (base + rel), world / up / "d" / Path(rel).name)
    (world / "secret.txt").write_bytes(H.SECRET)
    return world


def _one_file_per_value(item: Path) -> None:
    """Each indirect value moved into a data file of its own, named ``d/<i as 32 hex>``:
    Orbax names its files at random and puts the values in one or two of them, and the drawn
    tables must be the same on every run (``derandomize``)."""
    entries, moved, old = C.leaf_entries(item), [], set()
    for i, e in enumerate(x for x in entries if x.inline is None):
        src = item / (e.base + e.rel)
        with open(src, "rb") as f:
            f.seek(e.offset)
            data = f.read(e.length)
        rel = f"d/{i + 1:032x}"
        (item / "ocdbt.process_0" / rel).write_bytes(data)
        moved.append((e.key, rel))
        old.add(src)
    by_key = dict(moved)
    C.write_tree(
        item,
        [
            e
            if e.inline is not None
            else dataclasses.replace(e, base="ocdbt.process_0/", rel=by_key[e.key], offset=0)
            for e in entries
        ],
    )
    for f in old:
        f.unlink()


def _item(world: Path) -> Path:
    return world / "a" / "b" / "c" / "items"


def _components(hexes: list[str]):
    return st.sampled_from(
        [
            "",
            ".",
            "..",
            "d",
            "e",
            "ocdbt.process_0",
            *hexes,
            "%2e%2e",
            "%2E%2E",
            "..%2f",
            "%2F",
            "%00",
            "%",
            "a:b",
            "\0",
            "x" * 300,  # longer than a file name may be
            "é",
            "\udcff",  # a byte that is not UTF-8
            "secret.txt",
        ]
    ) | st.text(max_size=3)


@st.composite
def paths(draw, originals: list[str], hexes: list[str], world: Path) -> str:
    """One data-file path (base + relative), of one of several kinds."""
    kind = draw(st.sampled_from(["right", "right", "joined", "up", "absolute", "long"]))
    if kind == "right":
        return draw(st.sampled_from(originals))
    if kind == "joined":
        parts = draw(st.lists(_components(hexes), min_size=1, max_size=6))
        lead = draw(st.sampled_from(["", "", "/", "//"]))
        return lead + "/".join(parts) + draw(st.sampled_from(["", "", "/"]))
    if kind == "up":
        tail = draw(
            st.sampled_from(
                [f"d/{h}" for h in hexes]
                + ["secret.txt", "c/items/" + draw(st.sampled_from(originals))]
                + [str(world / "d" / h).lstrip("/") for h in hexes]
            )
        )
        return "../" * draw(st.integers(1, 35)) + tail
    if kind == "absolute":
        where = draw(st.sampled_from(["d", "a/d", "a/b/c/d"]))
        return str(world / where / draw(st.sampled_from(hexes)))
    # inside, but near or past PATH_MAX once joined to the item's own path
    return "x/" * draw(st.integers(1100, 2200)) + draw(st.sampled_from(hexes))


@st.composite
def tables(draw, keys: list[str], originals_by_key: list[str], hexes: list[str], world: Path):
    """``{key hex: [base, rel]}``: a path per indirect value (``originals_by_key``: each one's
    own), cut into base and relative at a random point (the two are joined)."""
    originals = sorted(set(originals_by_key))
    out = {}
    whole = draw(st.integers(0, 4)) == 0  # now and then every path the right one
    for k, original in zip(keys, originals_by_key, strict=True):
        p = original if whole else draw(paths(originals, hexes, world))
        cut = draw(st.integers(0, len(p)))
        out[k] = [p[:cut], p[cut:]]
    return out


def _run_child(world: Path, drawn: list[dict], tmp_path: Path):
    """The child over every table, on the item in ``world`` (under strace where there is
    one): its results, and the strace log or None."""
    tables_file, out = tmp_path / "tables.json", tmp_path / "results.json"
    tables_file.write_text(json.dumps(drawn))
    argv = [
        sys.executable,
        str(S.HERE / "rel_hostile_child.py"),
        str(_item(world)),
        str(tables_file),
        str(out),
    ]
    env = child_env({"PYTHONPATH": os.pathsep.join([str(S.REPO), str(S.TESTS), str(S.HERE)])})
    log = tmp_path / "strace.log" if H.STRACE else None
    if log is not None:
        res = H.traced(argv, log, cwd=S.REPO, env=env, timeout=600)
    else:
        res = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            cwd=S.REPO,
            env=env,
            timeout=600,
        )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), log


def test_data_file_tables_fuzz(world, tmp_path):
    item = _item(world)
    pristine = C.leaf_entries(item)
    indirect = [e for e in pristine if e.inline is None]
    keys = [e.key.hex() for e in indirect]
    hexes = sorted({Path(e.rel).name for e in indirect})
    right = {e.key.hex(): [e.base, e.rel] for e in indirect}
    drawn: list[dict] = []

    def issue_case(path: str) -> dict:
        return {k: ["", path] for k in keys}

    @SETTINGS
    @given(table=tables(keys, [e.base + e.rel for e in indirect], hexes, world))
    @example(table=right)
    @example(table={k: ["", b + r] for k, (b, r) in right.items()})
    @example(table=issue_case("../../outside/d/" + hexes[0]))
    @example(table=issue_case(str(world / "d" / hexes[0])))
    @example(table={k: [str(world) + "/", "d/" + hexes[0]] for k in keys})
    @example(table=issue_case("../../../../secret.txt"))
    @example(table=issue_case("../" * 30 + str(world / "d" / hexes[0]).lstrip("/")))
    @example(table=issue_case("d/" + hexes[0] + "\0/../../../../d/" + hexes[0]))
    def draw(table):
        drawn.append(table)

    draw()
    S.count("fuzzed", len(drawn))
    results, log = _run_child(world, drawn, tmp_path)
    assert len(results) == len(drawn)

    findings = []
    for i, (table, rec) in enumerate(zip(drawn, results, strict=True)):
        out_of_item = sorted({b + r for b, r in table.values() if leaves(b + r)})
        what = f"table {i} {_short(table)}"
        if rec["escaped"]:
            findings.append(f"{what}: escaped {rec['escaped']}")
            continue
        opened = rec.get("open", "")
        right_files = all(b + r == "".join(right[k]) for k, (b, r) in table.items())
        S.count(
            "hostile tables: " + ("leave" if out_of_item else "right" if right_files else "inside")
        )
        if out_of_item:
            if not (opened.startswith("refused") and LEAVES in opened):
                findings.append(f"{what}: not refused at open: {opened[:300]}")
            damaged = rec.get("damaged", {})
            for p in out_of_item:
                if LEAVES not in damaged.get(p, ""):
                    findings.append(f"{what}: damaged_value_files on {p!r}: {damaged.get(p)}")
        elif opened != "ok":
            findings.append(f"{what}: refused though every path stays inside: {opened[:300]}")
        elif right_files:
            if set(rec["reads"].values()) != {"equal"} or rec.get("damaged"):
                findings.append(f"{what}: the right files, yet {rec['reads']} {rec.get('damaged')}")
        elif any(LEAVES in v for v in rec.get("damaged", {}).values()):
            findings.append(f"{what}: an inside path reported as leaving: {rec['damaged']}")
    assert not findings, "\n".join(findings[:20])

    if log is None:
        pytest.skip(
            "strace is not installed, or may not trace here: the tables were checked, not the system calls"
        )
    findings = _outside_calls(log, world, item, drawn)
    assert not findings, "\n".join(findings[:20])


def test_an_overlong_path_inside_the_item_is_a_read_error(world):
    from etils import epath

    from orbax_maxtext_layout import CheckpointReadError
    from orbax_maxtext_layout.orbax_io import (
        item_writer,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    item = _item(world)
    entries = C.remapped(C.leaf_entries(item), lambda b, r: ("", "x" * 300 + "/" + r))
    C.write_tree(item, entries)
    assert not any(leaves(e.base + e.rel) for e in entries if e.inline is None)
    src = ItemReader.open(epath.Path(item), item_writer.ts_context())
    with pytest.raises(CheckpointReadError):
        src.read_whole("params.params.big")


def _short(table: dict) -> str:
    """A table for a message: keys decoded, paths over 80 characters cut in the middle."""

    def cut(p: str) -> str:
        return p if len(p) <= 80 else f"{p[:40]}...({len(p)} chars)...{p[-30:]}"

    return repr({bytes.fromhex(k).decode(): [cut(b), cut(r)] for k, (b, r) in table.items()})


def _outside_calls(log: Path, world: Path, item: Path, drawn: list[dict]) -> list[str]:
    """System calls that named a path beside the item (in ``world``, neither in the item nor
    one of its ancestors) or an outside path a table named."""
    world_s, item_s = str(world), str(item)
    ancestors = {str(p) for p in [item, *item.parents]}
    named_outside = set()
    for table in drawn:
        for b, r in table.values():
            p = (b + r).split("\0")[0]  # what a C string of it names
            if leaves(b + r):
                named_outside.add(os.path.normpath(os.path.join(item_s, p)))
    named_outside -= ancestors | {item_s}
    current = "start"
    hits = []
    for line, paths in H.logged_paths(log, cwd=S.REPO):
        for p in paths:
            if p.startswith(MARKER + "/"):
                current = p[len(MARKER) + 1 :]
                continue
            inside = p == item_s or p.startswith(item_s + "/") or p in ancestors
            beside = (p == world_s or p.startswith(world_s + "/")) and not inside
            if beside or (p in named_outside and not inside):
                hits.append(f"table {current}: {line[:400]}")
    return hits
