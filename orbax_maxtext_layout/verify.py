"""Check a converted step: every leaf of ``items`` equals its op applied to the legacy items.

The plan is replayed from the provenance the conversion recorded (optimizer
mode, drops, scan change and its layer axes) against the written ``items`` as
target, so a scan change verifies exactly like a plain conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from etils import epath

from . import merge, tskv
from .errors import LayoutMismatchError
from .layout import MAXTEXT_ITEM, read_provenance, tunix_items
from .moves import Op, Plan, apply_op
from .orbax_files import param_name
from .paths import keystr
from .plan import plan_step
from .rescan import with_scan_axes
from .spec import read_specs
from .target import Target


@dataclasses.dataclass
class VerifyResult:
    step_dir: str
    ok: bool
    checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


def replay_plan(step_dir: epath.PathLike) -> Plan:
    """The plan a converted step was written from, rebuilt from its provenance and metadata.

    The converted items are themselves the target; what was dropped on purpose is
    in the provenance record and is ignored by exact path.
    """
    step_dir = epath.Path(step_dir)
    prov = read_provenance(step_dir) or {}
    dropped = [d["path"].split("/", 1)[1] for d in prov.get("dropped", [])]
    target = Target.from_checkpoint(step_dir / MAXTEXT_ITEM)
    scan = prov.get("scan")
    if scan:
        target = with_scan_axes(target, dict(prov.get("scan_axes") or {}))
    ignore = [p.removesuffix("/value") for p in dropped] + dropped
    return plan_step(
        step_dir, target, optimizer=prov.get("optimizer", "convert"), ignore=ignore, scan=scan
    )


def verify_step(step_dir: epath.PathLike, *, quick: bool = False) -> VerifyResult:
    """Compares ``items`` with the legacy items it was converted from (or, for a merged
    LoRA step, with the base and adapters it was merged from).

    ``quick`` compares metadata (tree, shapes, dtypes, key impls) and checks that
    every leaf has stored data, without reading values. Otherwise every leaf is
    compared with its op applied to its sources: stored bytes where the op copied
    them, decoded values where it changed them (a cast, a layer slice or stack,
    fresh state, a zarr format change). Never raises: a failure is a result.
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
    prov = read_provenance(step_dir) or {}
    if prov.get("source_layout") == merge.SOURCE_LAYOUT:
        plan, sources = merge.replay_merge(step_dir, prov)
    else:
        plan, sources = replay_plan(step_dir), tunix_items(step_dir)
    got = read_specs(step_dir / MAXTEXT_ITEM)
    for m in plan.moves:
        if got.get(m.dst) != m.out_spec:
            res.problems.append(f"{keystr(m.dst)}: items has {got.get(m.dst)}, plan {m.out_spec}")
    extra = sorted(set(got) - {m.dst for m in plan.moves}, key=keystr)
    res.problems += [f"{keystr(p)}: in items, but written by no move of the plan" for p in extra]
    res.checked = len(plan.moves)
    if not res.problems:
        res.problems += _compare(step_dir, plan, sources, quick)
    res.ok = not res.problems
    return res


def _compare(
    step_dir: epath.Path, plan: Plan, sources: Mapping[str, epath.Path], quick: bool
) -> list[str]:
    ctx = tskv.ts_context()
    srcs = {n: tskv.SourceItem.open(d, ctx) for n, d in sources.items()}
    dst = tskv.SourceItem.open(step_dir / MAXTEXT_ITEM, ctx)
    problems = []
    stored = tskv.keys_by_array(dst.kv) if quick else {}
    for m in plan.moves:
        if quick:
            if not stored.get(param_name(m.dst)):
                problems.append(f"{keystr(m.dst)}: no stored data in items")
            continue
        if m.op is Op.COPY and srcs[m.item].use_zarr3 == dst.use_zarr3:
            if _raw_equal(srcs[m.item], m.src, dst, m.dst):
                continue
        want = apply_op(m, lambda item, p: tskv.read_array(srcs[item], p, ctx))
        have = tskv.read_array(dst, m.dst, ctx)
        if want.dtype != have.dtype or want.shape != have.shape or want.tobytes() != have.tobytes():
            problems.append(f"{keystr(m.dst)}: value differs from {m.describe()}")
    return problems


def _raw_equal(src: tskv.SourceItem, sp, dst: tskv.SourceItem, dp) -> bool:
    sn, dn = param_name(sp), param_name(dp)
    skeys = tskv.keys(src.kv, sn)
    dkeys = tskv.keys(dst.kv, dn)
    if [k[len(sn) :] for k in skeys] != [k[len(dn) :] for k in dkeys]:
        return False
    return all(
        src.kv.read(a).result().value == dst.kv.read(b).result().value
        for a, b in zip(skeys, dkeys, strict=True)
    )
