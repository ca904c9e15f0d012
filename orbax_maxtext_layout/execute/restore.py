"""The one restore core: a Tunix-layout step read straight into a MaxText items request.

`RestoreRequest` serves `MaxTextLayoutHandler`, `load_params_from_path` and both managers
alike: it turns the request (an items tree of abstract leaves, with its restore args) into
a `Target` once, plans the
step against it (metadata only), narrows the plan to the leaves asked for, reads only
those (each into its requested sharding) and assembles them in the request's structure.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ..base.treepaths import FlatTree, Path, flatten, keystr, norm_key, unflatten
from ..errors import CheckpointReadError, LayoutMismatchError, UsageError
from ..model.target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, STEP_PATH, Target
from ..orbax_io.layout import tunix_items
from ..orbax_io.orbax_files import absolute, param_name, reads_only
from ..orbax_io.reader import ItemReader
from ..plan.moves import Plan
from ..plan.step_plan import OptimizerMode, narrow, plan_step
from . import restore_engine

logger = logging.getLogger(__name__)
RestoreFn = Callable[[epath.Path, ocp.args.PyTreeRestore], Any]
SECTIONS = frozenset({PARAMS_ROOT[0], AUX_ROOT[0], OPT_ROOT[0], STEP_PATH[0]})


# -- reading the planned source leaves --------------------------------------------------
def _restore_arg(abstract: Any) -> ocp.RestoreArgs:
    sharding = getattr(abstract, "sharding", None)
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    # Restore straight into the destination's sharding: each host reads only its
    # shards, and nothing is gathered onto one host.
    return ocp.ArrayRestoreArgs(
        sharding=sharding, global_shape=abstract.shape, dtype=abstract.dtype
    )


def read_leaves(
    item_dir: epath.Path,
    paths: set[Path],
    abstract: Mapping[Path, Any] | None = None,
    restore: RestoreFn | None = None,
) -> FlatTree:
    """Reads only ``paths`` of an item (a partial restore): through the restore engine
    (`restore_engine`) where it takes a leaf, with Orbax for the rest.

    Without an ``abstract`` leaf (``{src path: abstract leaf}``) a leaf comes back as
    a host numpy array in its stored form (PRNG keys as raw data), independent of
    the devices recorded in the source's ``_sharding``; with one that has a
    ``sharding``, as a jax.Array placed with it. ``restore`` is the PyTree restore to
    use (a handler's own, so its options apply).
    """
    return read_items({"": (item_dir, paths, abstract or {})}, restore)[""]


def read_items(
    wanted: Mapping[str, tuple[epath.Path, set[Path], Mapping[Path, Any]]],
    restore: RestoreFn | None = None,
) -> dict[str, FlatTree]:
    """`read_leaves` of several items (``{name: (item_dir, paths, abstract)}``): what the
    engine takes from all of them in one run (their chunks decoded side by side), the rest
    with Orbax item by item."""
    empty = {name: {} for name, (_, paths, _) in wanted.items() if not paths}
    wanted = {k: w for k, w in wanted.items() if k not in empty}
    if not wanted:
        return empty
    asked = {
        name: {p: _request(abstract.get(p)) for p in paths}
        for name, (_, paths, abstract) in wanted.items()
    }
    if restore_engine.enabled():
        readers = {name: ItemReader.open(absolute(d)) for name, (d, _, _) in wanted.items()}
        got, stock = _engine_reads_from(
            readers, {name: d for name, (d, _, _) in wanted.items()}, asked
        )
    else:
        for name, (d, _, _) in wanted.items():
            _log_split(d, 0, 0, {restore_engine.ENV + "=stock": len(asked[name])})
        got, stock = {name: {} for name in wanted}, {name: set(a) for name, a in asked.items()}
    for name, (d, _, abstract) in wanted.items():
        if stock[name]:
            got[name].update(_stock_leaves(d, stock[name], abstract, restore))
    return {**empty, **got}


def _request(abstract: Any) -> tuple[tuple[int, ...] | None, Any, Any]:
    """``(shape, dtype, sharding)`` a leaf is asked for in (None: as stored, on the host)."""
    sharding = getattr(abstract, "sharding", None)
    if sharding is None:
        return None, None, None
    return tuple(abstract.shape), abstract.dtype, sharding


def _engine_reads_from(
    readers: Mapping[str, ItemReader],
    dirs: Mapping[str, epath.Path],
    asked: Mapping[str, Mapping[Path, tuple[Any, Any, Any]]],
) -> tuple[dict[str, FlatTree], dict[str, set[Path]]]:
    """Of the leaves ``asked`` (``{item: {path: (shape, dtype, sharding)}}``, each None for
    the stored form on the host), those the engine takes, read in one run; and the paths
    it leaves to Orbax. One debug line per item counts both ways."""
    reads, stock = {}, {}
    for item, reader in readers.items():
        requests, stock[item], why = _engine_requests(reader, asked[item])
        reads.update({(item, p): (reader, r) for p, r in requests.items()})
        _log_split(dirs[item], len(requests), sum(r.nbytes for r in requests.values()), why)
    got = restore_engine.read_across(reads) if reads else {}
    out: dict[str, FlatTree] = {item: {} for item in readers}
    for (item, p), x in got.items():
        out[item][p] = x
    return out, stock


def _engine_requests(
    reader: ItemReader, asked: Mapping[Path, tuple[Any, Any, Any]]
) -> tuple[dict[Path, restore_engine.ArrayRequest], set[Path], dict[str, int]]:
    """The engine's requests among ``asked``, the paths left to Orbax, and why (counted)."""
    requests, stock, why = {}, set(), {}
    for p, (shape, dtype, sharding) in asked.items():
        name = param_name(p)
        lay = reader.layout(name)
        if lay is None:
            stock.add(p)
            why["no zarr metadata"] = why.get("no zarr metadata", 0) + 1
            continue
        req = restore_engine.ArrayRequest(
            name,
            lay.shape if shape is None else shape,
            lay.dtype if dtype is None else dtype,
            sharding,
        )
        reason = restore_engine.why_not(reader, req)
        if reason is None:
            requests[p] = req
        else:
            stock.add(p)
            why[reason] = why.get(reason, 0) + 1
    return requests, stock, why


def _log_split(item_dir: epath.Path, n: int, nbytes: int, why: Mapping[str, int]) -> None:
    logger.debug(
        "%s: %d arrays (%.1f MiB) read by the restore engine, %d the stock way%s",
        item_dir,
        n,
        nbytes / 2**20,
        sum(why.values()),
        f" ({', '.join(f'{k}: {v}' for k, v in sorted(why.items()))})" if why else "",
    )


def _stock_leaves(
    item_dir: epath.Path,
    paths: set[Path],
    abstract: Mapping[Path, Any],
    restore: RestoreFn | None,
) -> FlatTree:
    """``paths`` read with Orbax (a partial restore)."""
    # The restore args are the item: Orbax takes a leaf's args from an item leaf that is
    # one, so it trims only its metadata tree to the request, not a second tree of args.
    item = unflatten({p: _restore_arg(abstract.get(p)) for p in paths})
    try:
        restore = restore or (lambda d, a: ocp.PyTreeCheckpointHandler().restore(d, args=a))
        tree = restore(absolute(item_dir), ocp.args.PyTreeRestore(item=item, partial_restore=True))
    except Exception as e:  # tensorstore/Orbax raise many types for damaged data
        raise CheckpointReadError(f"{item_dir}: cannot read array data: {e}") from e
    out: FlatTree = {}
    for p in paths:
        node: Any = tree
        for k in p:
            node = node[k]
        out[p] = node
    return out


def read_sources(
    step_dir: epath.Path,
    plan: Plan,
    abstract: Mapping[Path, Any] | None = None,
    restore: RestoreFn | None = None,
) -> dict[str, FlatTree]:
    """Reads every source leaf the plan's moves use, and nothing else.

    ``abstract`` maps destination items paths to abstract leaves (e.g.
    `Target.abstract`); a leaf copied to a destination with a sharding is restored
    directly with it.
    """
    wanted = {}
    for name, item_dir in tunix_items(step_dir).items():
        moves = plan.moves_from(name)
        if not moves:
            continue  # e.g. optimizer='drop': the optimizer item is never opened
        placed = {
            m.src: abstract[m.dst]
            for m in moves
            if abstract and m.dst in abstract and m.op.elementwise
        }
        wanted[name] = (item_dir, {p for m in moves for p in m.sources}, placed)
    return read_items(wanted, restore)


# -- a MaxText (or any PyTree) item, as stock restores it --------------------------------
_ARRAY_VALUES = frozenset({"jax.Array", "np.ndarray"})


def restore_pytree(item_dir: epath.Path, args: ocp.args.PyTreeRestore, stock: RestoreFn) -> Any:
    """What ``stock(item_dir, args)`` (a PyTreeCheckpointHandler's restore) returns, its
    arrays read by the restore engine where the request says exactly how to place them.

    A leaf goes to the engine when its restore args say where it goes: an
    ``ArrayRestoreArgs`` with a ``sharding`` (a jax.Array), or ``RestoreArgs`` with
    ``restore_type=np.ndarray`` (a host array), and the engine takes its stored array
    (`restore_engine.why_not`). Everything else (scalars, PRNG keys, leaves placed from the
    recorded sharding, transforms, items that do not match the stored tree) is read by
    ``stock``, with the engine's leaves skipped (``ocp.PLACEHOLDER``).
    """
    item = args.item
    transforms = getattr(args, "transforms", None)  # v1's args have neither
    plain = transforms is None and not args.partial_restore
    if (
        item is None
        or getattr(args, "legacy_transform_fn", None) is not None
        or transforms not in (None, {})
        or not restore_engine.enabled()
    ):
        return stock(item_dir, args)
    leaves = flatten(item, is_leaf=is_request_leaf)
    rargs = flatten(args.restore_args, is_leaf=is_request_leaf) if args.restore_args else {}
    reader = ItemReader.open(absolute(item_dir))
    if plain and {param_name(p) for p in leaves} != set(reader.files.value_meta):
        return stock(item_dir, args)  # stock refuses a tree that is not the stored one
    asked = {}
    for p, leaf in leaves.items():
        want = _placed(leaf, rargs.get(p), reader.files.value_meta.get(param_name(p)))
        if want is not None:
            asked[p] = want
    got, rest = _engine_reads_from({"": reader}, {"": item_dir}, {"": asked})
    got, rest = got[""], rest[""]
    rest |= {p for p, leaf in leaves.items() if p not in got and leaf is not ocp.PLACEHOLDER}
    if not got:
        return stock(item_dir, args)
    if rest and not plain:
        # Orbax takes placeholders only in a restore of the whole stored tree: a subtree
        # or partial request that the engine cannot read whole goes stock.
        return stock(item_dir, args)
    restored = None
    if rest:
        skip = lambda kp, x: ocp.PLACEHOLDER if _path(kp) in got else x  # noqa: E731
        restored = stock(
            item_dir,
            dataclasses.replace(
                args,
                item=jax.tree_util.tree_map_with_path(skip, item, is_leaf=is_request_leaf),
                restore_args=jax.tree_util.tree_map_with_path(
                    skip, args.restore_args, is_leaf=is_request_leaf
                )
                if args.restore_args is not None
                else None,
            ),
        )
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: got.get(_path(kp), x),
        item if restored is None else restored,
        is_leaf=is_request_leaf,
    )


def _path(kp: tuple) -> Path:
    return tuple(norm_key(k) for k in kp)


def _placed(leaf: Any, arg: Any, value_meta: Any) -> tuple | None:
    """``(shape, dtype, sharding)`` the request places a stored array leaf in, when its
    restore args say exactly that (else None: the stock way)."""
    if leaf is ocp.PLACEHOLDER or not isinstance(value_meta, Mapping):
        return None
    if value_meta.get("value_type") not in _ARRAY_VALUES or value_meta.get("skip_deserialize"):
        return None
    if isinstance(arg, ocp.ArrayRestoreArgs):
        if arg.sharding is None or not isinstance(arg.sharding, jax.sharding.Sharding):
            return None
        if arg.restore_type not in (None, jax.Array) or arg.mesh is not None:
            return None
        shape = arg.global_shape if arg.global_shape is not None else getattr(leaf, "shape", None)
        if shape is None:
            return None
        return tuple(shape), arg.dtype, arg.sharding
    if type(arg) is ocp.RestoreArgs and arg.restore_type is np.ndarray:
        return None, arg.dtype, None
    # Orbax v1's (`V0RestoreArgs`): a jax.Array placed and cast as its abstract leaf says.
    abstract = getattr(arg, "abstract_leaf", None)
    if getattr(arg, "restore_type", None) is jax.Array and abstract is not None:
        sharding = getattr(abstract, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding) and hasattr(abstract, "dtype"):
            return tuple(abstract.shape), abstract.dtype, sharding
    return None


# -- assembling the items tree ----------------------------------------------------------
def _is_key_data(x: Any) -> bool:
    return not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _own(x: Any) -> Any:
    """A copy of ``x`` in a buffer of its own (on its devices, for a jax.Array)."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, x.sharding, may_alias=False)
    return np.array(x, copy=True)


def assemble(plan: Plan, sources: Mapping[str, FlatTree]) -> dict:
    """Builds the MaxText items tree from source leaves, following ``plan`` exactly
    (`assemble_flat`, nested)."""
    return unflatten(assemble_flat(plan, sources))


def assemble_flat(plan: Plan, sources: Mapping[str, FlatTree]) -> FlatTree:
    """``{items path: leaf}`` of every destination of ``plan``, from source leaves.

    ``sources`` maps item name to ``{src path: array}``. Stored-form key data is
    rewrapped as typed keys, so MaxText resumes get ``key<...>`` arrays and not raw
    uint32. Every leaf is its own buffer, even when one source leaf feeds two
    destinations (MaxText's train step donates its state buffers).
    """
    flat: FlatTree = {}
    used: set[int] = set()
    for m in plan.moves:
        x = m.op.assemble(m, lambda item, p: sources[item][p])  # a copy: the leaf as given
        if m.out_spec.key_impl and _is_key_data(x):
            x = jax.random.wrap_key_data(jax.numpy.asarray(x), impl=m.out_spec.key_impl)
        if id(x) in used:
            x = _own(x)
        used.add(id(x))
        flat[m.dst] = x
    return flat


# -- a request --------------------------------------------------------------------------
def is_request_leaf(x: Any) -> bool:
    return x is ocp.PLACEHOLDER or isinstance(x, ocp.RestoreArgs) or hasattr(x, "dtype")


def asks_for_items(item: Any) -> bool:
    """True unless ``item`` is a tree in some other layout (e.g. Tunix's own NNX form).

    ``None`` counts as an items request, so it is refused with a clear message
    instead of silently handing back the unconverted Tunix tree.
    """
    return item is None or (isinstance(item, Mapping) and bool(item) and set(item) <= SECTIONS)


def _abstract_leaf(leaf: Any, arg: Any) -> jax.ShapeDtypeStruct:
    """The leaf to restore into: shape/dtype from ``item``, sharding as Orbax would pick it."""
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:  # a Python scalar in item, or no item leaf at all
        if leaf is not None:
            shape, dtype = np.shape(leaf), np.asarray(leaf).dtype
        else:
            shape, dtype = getattr(arg, "global_shape", None), getattr(arg, "dtype", None)
    if dtype is None or shape is None:
        raise UsageError("Cannot tell the shape and dtype to restore; pass an abstract item.")
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = None  # e.g. Orbax ArrayMetadata's ShardingMetadata: not a placement
    if isinstance(arg, ocp.ArrayRestoreArgs) and arg.sharding is not None:
        sharding = arg.sharding
    elif isinstance(arg, ocp.RestoreArgs) and arg.restore_type is np.ndarray:
        sharding = None  # explicitly asked for host arrays
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True, eq=False)  # item holds arrays: compared by identity
class RestoreRequest:
    """A restore of a Tunix-layout step as the MaxText items ``item`` asks for.

    Built once (`of`): the request tree is flattened there, and everything after works
    on flat ``{items path: leaf}`` mappings: ``target.abstract`` holds the abstract leaf
    of every path asked for (``skipped`` the ``ocp.PLACEHOLDER`` paths), the plan, the
    reads and the assembled leaves are flat, and `restore` builds the result in
    ``item``'s own structure (its tuples, namedtuples and lists kept) once, at the end.

    Which checkpoint leaves must be accounted for: when ``item`` names ``nnx_aux`` and
    the request is not ``explicit`` (neither ``partial_restore`` nor ``transforms`` is
    given and nothing is a placeholder), it describes the whole model and every
    ``model_params`` leaf must fit it (as for a conversion). Otherwise the request is
    partial: checkpoint leaves it does not name are skipped unread. ``optimizer_state``
    is opened only when ``item`` asks for ``opt_state`` or ``step``;
    ``optimizer="drop"`` never reads it and leaves ``opt_state`` out of the result. A
    requested leaf the step does not hold raises `LayoutMismatchError`, unless
    ``keep_missing`` (a manager resuming from a model-only step): it is then left as
    given in ``item``.
    """

    item: Any
    target: Target
    skipped: frozenset[Path] = frozenset()
    explicit: bool = False
    optimizer: OptimizerMode | None = None
    ignore: tuple[str, ...] = ()
    keep_missing: bool = False

    @classmethod
    def of(
        cls,
        item: Any,
        restore_args: Any = None,
        *,
        partial_restore: bool = False,
        transforms: Any = None,
        optimizer: OptimizerMode | None = None,
        ignore: Iterable[str] = (),
        keep_missing: bool = False,
    ) -> RestoreRequest:
        """The request for ``item`` (an items tree of abstract leaves) and its
        ``restore_args`` (each leaf's sharding, as Orbax takes them)."""
        target, skipped = _request_target(item, restore_args)
        explicit = bool(partial_restore or transforms is not None or skipped)
        return cls(
            item, target, frozenset(skipped), explicit, optimizer, tuple(ignore), keep_missing
        )

    @property
    def wanted(self) -> Target:
        """The target restored: ``target`` without its optimizer for ``optimizer="drop"``."""
        if self.optimizer != "drop":
            return self.target
        abstract = {p: v for p, v in self.target.abstract.items() if p[:1] != OPT_ROOT}
        return Target(self.target.params, self.target.nnx_aux, abstract=abstract)

    @reads_only
    def restore(
        self,
        step_dir: epath.Path,
        *,
        restore: RestoreFn | None = None,
        specs: MutableMapping[str, FlatTree] | None = None,
    ) -> Any:
        """Reads ``step_dir`` (a Tunix-layout step) as requested. ``restore`` is the PyTree
        restore to read with (a handler's own); ``specs`` the caller's cache of the step's
        item specs (see `plan_step`)."""
        target = self.wanted
        if not target.abstract:
            raise LayoutMismatchError(f"{step_dir}: the item asks for no leaves.")
        if not self.explicit and not target.model_paths():
            _refuse_modelless(step_dir, self.ignore, specs)
        plan = plan_request(
            step_dir,
            target,
            optimizer="drop" if target.opt_state is None else "convert",
            ignore=self.ignore,
            partial=self.explicit or not target.nnx_aux,
            specs=specs,
        )
        flat = assemble_flat(plan, read_sources(step_dir, plan, target.abstract, restore))
        for p, x in flat.items():  # leaves made on the host (e.g. a step from the directory name)
            sharding = getattr(target.abstract.get(p), "sharding", None)
            if sharding is not None and not isinstance(x, jax.Array):
                flat[p] = jax.device_put(x, sharding)
        missing = [keystr(p) for p in sorted(set(target.abstract) - set(flat), key=keystr)]
        if missing and not self.keep_missing:  # the plan checks this already; never a hole
            raise LayoutMismatchError(f"{step_dir}: no checkpoint value for", missing)
        if missing:  # e.g. opt_state of a model-only step: left as given, like partial_restore
            logger.warning("%s does not hold %s; left as in `item`.", step_dir, missing)
        return self._result(flat)

    def _result(self, flat: FlatTree) -> Any:
        """The restored leaves in ``item``'s structure (one pass over it)."""

        def fill(kp: tuple, leaf: Any) -> Any:
            path = tuple(norm_key(k) for k in kp)  # jax key path -> `flatten`'s path
            if path in self.skipped:
                return leaf
            return flat.get(path, leaf if self.keep_missing else ocp.PLACEHOLDER)

        out = jax.tree_util.tree_map_with_path(fill, self.item)
        if self.optimizer == "drop" and isinstance(out, dict):
            out = {k: v for k, v in out.items() if k != OPT_ROOT[0]}
        return out


def _request_target(item: Any, restore_args: Any) -> tuple[Target, frozenset[Path]]:
    """The `Target` a request describes (abstract leaves with their shardings), and the
    paths it skips (``ocp.PLACEHOLDER``). The one flatten of the request."""
    if item is None:
        raise LayoutMismatchError(
            "A Tunix-layout step can only be restored against a target: pass item=.",
            hint="e.g. item={'params': {'params': abstract_params}} (MaxText's items layout).",
        )
    items = flatten(item, is_leaf=is_request_leaf)
    rargs = flatten(restore_args, is_leaf=is_request_leaf) if restore_args else {}
    skipped = frozenset(p for p, v in items.items() if v is ocp.PLACEHOLDER)
    abstract = {p: _abstract_leaf(v, rargs.get(p)) for p, v in items.items() if p not in skipped}
    return Target.from_flat_items(abstract) if abstract else Target({}, {}), skipped


def _refuse_modelless(
    step_dir: epath.Path, ignore: Iterable[str], specs: MutableMapping[str, FlatTree] | None
) -> None:
    """A request that names no model leaf would ignore every weight the step holds.

    Refused unless the caller asked for a partial restore (``partial_restore``,
    ``transforms`` or placeholders): a restore never drops weights silently. A LoRA
    adapter step gets its own error (`lora.LoraAdapterStepError`), from the planner.
    """
    plan = plan_step(
        step_dir, Target({}, {}), ignore=ignore, unnamed="skip", read_optimizer=False, specs=specs
    )
    weights = [d for d in plan.drops if d.reason == "not requested by the target"]
    if weights:
        raise LayoutMismatchError(
            f"{step_dir}: the request names none of the {len(weights)} model leaves the step "
            "holds; restoring it would keep no weight.",
            hint="Name the weights in the request (params/params/...), or pass "
            "partial_restore=True to restore only the parts named.",
        )


def plan_request(
    step_dir: epath.Path,
    target: Target,
    *,
    optimizer: OptimizerMode,
    ignore: Iterable[str] = (),
    partial: bool = False,
    specs: MutableMapping[str, FlatTree] | None = None,
) -> Plan:
    """Plans a restore of exactly the leaves in ``target.abstract``, from metadata.

    Opens ``optimizer_state`` only if ``opt_state`` or ``step`` is requested. With
    ``partial``, model leaves the target does not name are skipped (a params-only
    target says nothing about nnx_aux); requested leaves must still exist with the
    requested shape and dtype.
    """
    plan = plan_step(
        step_dir,
        target,
        optimizer=optimizer,
        ignore=ignore,
        unnamed="skip" if partial else "error",
        read_optimizer=target.opt_state is not None or STEP_PATH in target.abstract,
        specs=specs,
    )
    return narrow(plan, target.abstract)


@reads_only
def restore_as_items(
    step_dir: epath.PathLike,
    target: Target,
    *,
    optimizer: OptimizerMode = "convert",
    ignore: Iterable[str] = (),
) -> dict[str, Any]:
    """Restores a whole Tunix-layout step as MaxText items, in memory, against ``target``.

    Reads only the leaves the plan moves; a leaf whose target abstract value has a
    sharding is restored with that sharding.
    """
    step_dir = epath.Path(step_dir)
    plan = plan_step(step_dir, target, optimizer=optimizer, ignore=ignore)
    return assemble(plan, read_sources(step_dir, plan, target.abstract))
