"""The processes of one export: who writes what, how each says it is done, and how
process 0 finishes.

Process ``p`` of ``n`` (`processes`: given, or JAX's) writes its part (`write_part`):
shards ``p, p + n, ...``, each into a part file renamed into place, or, where the
processes share files (`export_plan.shares_files`), the tensors of the params it owns
(`_owned`) into one shared part file per shard. Then it writes its marker,
``.done-<p>``, holding the export's fingerprint; a rerun whose marker of the same export
is there skips its part. Process 0 waits for every marker of the same export
(`wait_for_all`), puts the shared parts in place, and publishes (`finish`): what is not
this export's goes, then the tokenizer, and the index and ``config.json`` (the export's
`formats.sink.Sink`: ``config.json`` last) are written, the markers go, and the work
directory becomes ``out`` (``config.json`` last on an object store).

The files are the sink's (`ExportPlan.sink`): laid out in the plan, each opened here as a
`PartWriter` (`Sink.open`), written by `export_stream`, closed or abandoned here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from typing import Any

from etils import epath

from ..errors import UsageError
from ..formats.sink import Part, PartWriter
from ..model import hf_mapping
from ..model.hf_mapping import Unit
from ..storage.store import StepStore
from .budget import group_bytes, largest_first
from .export_plan import ExportPlan, shares_files
from .export_stream import run_groups

CONFIG_FILE = "config.json"  # published last on an object store
DONE_PREFIX = ".done-"
PART = ".part."
WAIT_S = 24 * 3600  # process 0 waits this long for the others' shards


def write_part(ep: ExportPlan, work: epath.Path, index: int, count: int) -> None:
    """Process ``index`` of ``count``: its part of the export's files, then its marker;
    nothing where its marker of the same export is there already (a rerun after a kill)."""
    store = ep.store
    done = work / f"{DONE_PREFIX}{index}"
    budget = ep.report.memory["budget"]
    if marker(store, done) == ep.fingerprint:
        return
    done.unlink(missing_ok=True)
    if shares_files(store, count):
        _write_shared(ep, work, index, count, budget=budget)
    else:
        mine = [s for k, s in enumerate(ep.shards) if k % count == index]
        _write_shards(ep, work, mine, budget=budget)
    store.replace_file(done, ep.fingerprint)


def finish(
    ep: ExportPlan, work: epath.Path, out: epath.Path, hf_model_path: str | None
) -> list[str]:
    """Process 0, once its own part is written: waits for every process's marker of this
    export, puts the shared part files in place, and publishes ``out`` (`_publish`);
    returns the names of the files in ``out``."""
    count = ep.report.process["count"]
    wait_for_all(work, ep.fingerprint, count, ep.store)
    if shares_files(ep.store, count):
        _place_shared(ep, work)
    return _publish(ep, work, out, hf_model_path)


def processes(index: int | None, count: int | None) -> tuple[int, int]:
    if index is None and count is None:
        try:
            import jax

            if jax.process_count() > 1:
                return jax.process_index(), jax.process_count()
        except Exception:
            pass
        return 0, 1
    if index is None or count is None or not 0 <= index < count:
        raise UsageError("--process-index and --process-count go together, 0 <= index < count.")
    return index, count


def marker(store: Any, path: epath.Path) -> str | None:
    """The fingerprint a process's marker holds (None: no marker)."""
    store.refresh(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def wait_for_all(work: epath.Path, fingerprint: str, count: int, store: StepStore) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        missing = [
            p for p in range(count) if marker(store, work / f"{DONE_PREFIX}{p}") != fingerprint
        ]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{work}: processes {missing} did not write their shards.")
        time.sleep(0.2)


def _publish(
    ep: ExportPlan, work: epath.Path, out: epath.Path, hf_model_path: str | None
) -> list[str]:
    """Process 0, once every shard is there: what is not this export's goes (another
    export's shards, parts of killed writers, a killed ``_publish``'s files), then the
    tokenizer, the index and config.json (`Sink.finish`); then the markers go, and ``work``
    becomes ``out`` (config.json last on an object store)."""
    store = ep.store
    ours = {s.name for s in ep.shards}
    store.refresh(work)
    for f in work.iterdir():
        if f.name not in ours and not f.name.startswith(DONE_PREFIX):
            if f.is_dir():
                f.rmtree()
            else:
                f.unlink(missing_ok=True)
    if hf_model_path:
        staging = epath.Path(tempfile.mkdtemp(prefix="orbax-maxtext-layout-tokenizer-"))
        try:
            for name in hf_mapping.save_tokenizer(hf_model_path, str(staging)):
                store.put_file(staging / name, work / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ep.sink.finish(store, work, ep.shards, (CONFIG_FILE, hf_mapping.config_json(ep.model)))
    for p in range(ep.report.process["count"]):
        (work / f"{DONE_PREFIX}{p}").unlink(missing_ok=True)
    store.publish_dir(work, out, last=CONFIG_FILE)
    store.refresh(out)
    return sorted(f.name for f in out.iterdir())


def _write_shards(ep: ExportPlan, work: epath.Path, shards: list[Part], *, budget: int) -> None:
    """Writes ``shards`` (each to a part file renamed into place when complete)."""
    if not shards:
        return
    wanted = {t.name for s in shards for t in s.tensors}
    files: dict[str, PartWriter] = {}
    where: dict[str, PartWriter] = {}
    who = f"{PART}{socket.gethostname()}.{os.getpid()}"
    store = ep.store
    staging = store.staging_dir(work)
    parts = {s.name: staging / f"{s.name}{who}" for s in shards}
    try:
        for s in shards:
            f = files[s.name] = ep.sink.open(s, str(parts[s.name]))
            where.update({t.name: f for t in s.tensors})
        groups: dict[tuple[str, ...], list[Unit]] = {}
        for u in ep.units:
            if any(n in wanted for n in u.names):
                groups.setdefault(u.keys, []).append(u)
        run_groups(ep, groups, where, budget)
        for s in shards:
            files[s.name].close()
            store.put_file(parts[s.name], work / s.name)
    except BaseException:
        for f in files.values():
            with contextlib.suppress(OSError):
                f.abandon()
        raise
    finally:
        if str(staging) != str(work):
            shutil.rmtree(staging, ignore_errors=True)


def _shared_part(shard: Part, fingerprint: str) -> str:
    """The part file every process of a shared export writes ``shard`` into."""
    return f"{shard.name}{PART}shared.{fingerprint[:16]}"


def _write_shared(ep: ExportPlan, work: epath.Path, index: int, count: int, *, budget: int):
    """Process ``index`` of ``count`` sharing the export's files: it decodes only the
    params it owns (`_owned`: whole params, balanced by bytes) and writes each of their
    tensors into the part file of its shard, which every process opens (`Sink.open` with
    ``shared``). Each stored chunk is decoded by one process only, where a split by shards
    would have every process decode every stacked param for its own layers."""
    files = {
        s.name: ep.sink.open(s, str(work / _shared_part(s, ep.fingerprint)), shared=True)
        for s in ep.shards
    }
    where = {t.name: files[s.name] for s in ep.shards for t in s.tensors}
    try:
        run_groups(ep, _owned(ep, index, count), where, budget)
        for f in files.values():
            f.close()  # fsync: this process's writes are on the disk before its marker
    except BaseException:
        for f in files.values():
            with contextlib.suppress(OSError):
                f.abandon()
        raise


def _owned(ep: ExportPlan, index: int, count: int) -> dict[tuple[str, ...], list[Unit]]:
    """The params (with their units) process ``index`` of ``count`` exports: every param
    goes to the process with the fewest bytes so far, largest first (the same split on
    every process: it depends on the plan only)."""
    groups: dict[tuple[str, ...], list[Unit]] = {}
    for u in ep.units:
        groups.setdefault(u.keys, []).append(u)
    load = [0] * count
    mine: dict[tuple[str, ...], list[Unit]] = {}
    for ks in largest_first(ep.moves, groups):
        p = load.index(min(load))
        load[p] += group_bytes(ep.moves, ks)
        if p == index:
            mine[ks] = groups[ks]
    return mine


def _place_shared(ep: ExportPlan, work: epath.Path) -> None:
    """Process 0, once every process's marker is there: each shared part file renamed to
    its shard's name (a rerun finds some already renamed)."""
    store = ep.store
    for s in ep.shards:
        part = work / _shared_part(s, ep.fingerprint)
        if part.exists():
            store.put_file(part, work / s.name)
        elif not (work / s.name).exists():
            raise FileNotFoundError(f"{work}: {s.name} was written by no process.")
