"""Check that a converted step's ``items`` holds every source leaf, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorstore as ts
from etils import epath

from . import kvcopy
from ._tree import keystr
from .errors import LayoutMismatchError
from .layout import MAXTEXT_ITEM, read_provenance
from .plan import Plan
from .spec import read_specs
from .target import Target


@dataclasses.dataclass
class VerifyResult:
    step_dir: str
    ok: bool
    checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


def _replan(step_dir: epath.Path) -> Plan:
    # The converted items are themselves the target; what was dropped on purpose
    # is in the provenance record and is ignored by exact path.
    from .convert import plan_step

    prov = read_provenance(step_dir) or {}
    dropped = [d["path"].split("/", 1)[1] for d in prov.get("dropped", [])]
    target = Target.from_checkpoint(step_dir / MAXTEXT_ITEM)
    ignore = [p.removesuffix("/value") for p in dropped] + dropped
    return plan_step(step_dir, target, optimizer=prov.get("optimizer", "convert"), ignore=ignore)


def verify_step(step_dir: epath.PathLike, *, quick: bool = False) -> VerifyResult:
    """Compares ``items`` with the legacy items it was converted from.

    ``quick`` compares metadata (tree, shapes, dtypes, key impls) and checks that
    every leaf has stored data, without reading values. Otherwise every leaf's
    stored bytes are compared, falling back to decoded values where the bytes were
    re-encoded (a dtype cast or a zarr format change).
    """
    step_dir = epath.Path(step_dir)
    try:
        return _verify(step_dir, quick)
    except LayoutMismatchError as e:
        return VerifyResult(str(step_dir), False, 0, [e.summary, *e.problems])
    except Exception as e:  # unreadable metadata or data: a failed check, not a crash
        return VerifyResult(str(step_dir), False, 0, [f"cannot read: {e}"])


def _verify(step_dir: epath.Path, quick: bool) -> VerifyResult:
    res = VerifyResult(str(step_dir), ok=True)
    plan = _replan(step_dir)
    got = read_specs(step_dir / MAXTEXT_ITEM)
    for m in plan.moves:
        want = m.spec if m.cast is None else dataclasses.replace(m.spec, dtype=np.dtype(m.cast))
        if got.get(m.dst) != want:
            res.problems.append(f"{keystr(m.dst)}: items has {got.get(m.dst)}, source {want}")
    res.checked = len(plan.moves)
    if not res.problems:
        res.problems += _keys_present(step_dir, plan) if quick else _compare_values(step_dir, plan)
    res.ok = not res.problems
    return res


def _keys_present(step_dir: epath.Path, plan: Plan) -> list[str]:
    dst = kvcopy.SourceItem.open(step_dir / MAXTEXT_ITEM, kvcopy.ts_context())
    return [
        f"{keystr(m.dst)}: no stored data in items"
        for m in plan.moves
        if not kvcopy._keys(dst.kv, kvcopy.param_name(m.dst))
    ]


def _compare_values(step_dir: epath.Path, plan: Plan) -> list[str]:
    ctx = kvcopy.ts_context()
    from .engine import source_items

    srcs = {n: kvcopy.SourceItem.open(d, ctx) for n, d in source_items(step_dir).items()}
    dst = kvcopy.SourceItem.open(step_dir / MAXTEXT_ITEM, ctx)
    problems = []
    for m in plan.moves:
        src = srcs[m.item]
        same_codec = src.use_zarr3 == dst.use_zarr3 and m.cast is None
        if same_codec and _raw_equal(src, m.src, dst, m.dst):
            continue
        a = _decoded(src, m.src, ctx)
        b = _decoded(dst, m.dst, ctx)
        if m.cast is not None:
            a = a.astype(m.cast)
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            problems.append(f"{keystr(m.dst)}: value differs from {m.item}/{keystr(m.src)}")
    return problems


def _raw_equal(src: kvcopy.SourceItem, sp, dst: kvcopy.SourceItem, dp) -> bool:
    sn, dn = kvcopy.param_name(sp), kvcopy.param_name(dp)
    skeys = kvcopy._keys(src.kv, sn)
    dkeys = kvcopy._keys(dst.kv, dn)
    if [k[len(sn) :] for k in skeys] != [k[len(dn) :] for k in dkeys]:
        return False
    return all(
        src.kv.read(a).result().value == dst.kv.read(b).result().value
        for a, b in zip(skeys, dkeys, strict=True)
    )


def _decoded(item: kvcopy.SourceItem, path, ctx) -> np.ndarray:
    driver = "zarr3" if item.use_zarr3 else "zarr"
    kv = kvcopy.sub_kv(item.kv.spec().to_json(), kvcopy.param_name(path))
    return np.asarray(
        ts.open({"driver": driver, "kvstore": kv}, open=True, context=ctx).result().read().result()
    )
