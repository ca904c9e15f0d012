"""A PyTreeCheckpointHandler that restores Tunix-layout steps as MaxText items.

`MaxTextLayoutHandler` saves exactly like `ocp.PyTreeCheckpointHandler`. At
restore it looks at the directory it is given: a Tunix ``model_params`` item, or a
step (or its would-be ``items`` path) in Tunix layout, is restored through the
core conversion into the structure of the requested item; every other directory
restores the stock way. `load_params_from_path` is a drop-in for MaxText's
function of the same name that works on either layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from ..base.treepaths import flatten, keystr
from ..errors import CheckpointReadError, LayoutMismatchError, UsageError
from ..execute.restore import RestoreRequest, asks_for_items, is_request_leaf, restore_pytree
from ..hf.import_hf import is_hf_dir, load_params
from ..model.target import PARAMS_ROOT
from ..orbax_io.layout import (
    MAXTEXT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    step_dir_of,
)
from ..orbax_io.orbax_files import METADATA_FILE, reads_only
from ..orbax_io.spec import read_specs, spec_of
from ..plan.step_plan import OptimizerMode
from ..storage.store import StepStore, store_for

__all__ = [
    "MaxTextLayoutHandler",
    "MaxTextLayoutRestore",
    "MaxTextLayoutSave",
    "load_params_from_path",
    "tunix_step_of",
]

_is_leaf = is_request_leaf


class MaxTextLayoutHandler(ocp.PyTreeCheckpointHandler):
    """`ocp.PyTreeCheckpointHandler` that also restores Tunix-layout steps as MaxText items.

    Constructor arguments are PyTreeCheckpointHandler's, passed through. Saving is
    unchanged. ``restore(directory, ...)`` accepts the stock legacy keywords
    (``item``, ``restore_args``, ``transforms``), ``args=ocp.args.PyTreeRestore(...)``
    and ``args=MaxTextLayoutRestore(...)``:

    * ``directory`` is a Tunix ``<step>/model_params``, a Tunix ``<step>``, or a
      ``<step>/items`` path of a Tunix step (only when calling the handler
      directly: a Checkpointer refuses a directory that does not exist): the step
      is converted in memory into the structure of ``item`` (MaxText items
      layout: ``params/params/...``, ``nnx_aux/model/...``, ``opt_state``,
      ``step``). Only the leaves ``item`` asks for are read, each with the
      sharding of its ``restore_args`` entry (``ArrayRestoreArgs.sharding``) or of
      its ``item`` leaf; a leaf with neither comes back as a host ``np.ndarray``.
      ``LayoutMismatchError`` names every missing or mis-shaped leaf.
    * A MaxText ``<step>`` (holding ``items/``) restores its ``items`` the stock way.
    * Anything else restores the stock way.

    Which checkpoint leaves must be accounted for (see `MaxTextLayoutRestore`):
    when ``item`` names ``nnx_aux`` and neither ``partial_restore`` nor
    ``transforms`` is given, the request describes the whole model and every
    ``model_params`` leaf must fit it (as for `convert_step`). Otherwise the
    request is partial: checkpoint leaves it does not name are skipped unread.
    ``optimizer_state`` is opened only when ``item`` asks for ``opt_state`` or ``step``.
    """

    @classmethod
    def typestr(cls) -> str:
        # Stored in step metadata and used as the handler-registry key: must differ
        # from the stock PyTreeCheckpointHandler's.
        return "orbax_maxtext_layout.MaxTextLayoutHandler"

    @reads_only
    def restore(
        self,
        directory: epath.Path,
        item: Any = None,
        *,
        restore_args: Any = None,
        transforms: Any = None,
        transforms_default_to_original: bool = True,
        legacy_transform_fn: Any = None,
        args: ocp.args.PyTreeRestore | None = None,
    ) -> Any:
        # Orbax calls restore(directory, args=...); the legacy keywords are keyword-only
        # here (stock PyTreeCheckpointHandler takes them positionally too), and ``item``
        # stays positional for the legacy ``restore(directory, item)`` form.
        directory = epath.Path(directory)
        if args is None:
            args = MaxTextLayoutRestore(
                item, restore_args, transforms, transforms_default_to_original, legacy_transform_fn
            )
        store = store_for(directory)  # decided once for the restore, handed down
        step_dir = tunix_step_of(directory, store=store)
        if step_dir is not None and not asks_for_items(args.item):
            step_dir = None  # an item in the stored (NNX) form: restore it as stored
        if step_dir is None:
            if (
                not store.exists(directory / METADATA_FILE)
                and detect_layout(directory) is Layout.MAXTEXT
            ):
                directory = directory / MAXTEXT_ITEM  # a MaxText step: read its items
            # What stock returns, its arrays through the restore engine (`restore_pytree`).
            return restore_pytree(directory, args, self._stock_restore)
        if args.legacy_transform_fn is not None or args.transforms:
            # `transforms={}` is MaxText's idiom for "restore a subtree" and is honoured;
            # real transforms describe a stored tree this layout does not have.
            raise UsageError(
                f"{step_dir}: transforms and legacy_transform_fn are not supported for a "
                "Tunix-layout step; pass the MaxText-layout item to restore into instead."
            )

        request = RestoreRequest.of(
            args.item,
            args.restore_args,
            partial_restore=bool(args.partial_restore),
            transforms=args.transforms,
            optimizer=getattr(args, "optimizer", None),
            ignore=getattr(args, "ignore", ()),
        )
        return request.restore(step_dir, restore=self._stock_restore)

    def _stock_restore(self, directory: epath.Path, args: ocp.args.PyTreeRestore) -> Any:
        # Reads through this handler, so its constructor options (restore_concurrent_gb,
        # multiprocessing_options, type registry) apply.
        return ocp.PyTreeCheckpointHandler.restore(self, directory, args=args)


@ocp.args.register_with_handler(MaxTextLayoutHandler, for_save=True)
@dataclasses.dataclass
class MaxTextLayoutSave(ocp.args.PyTreeSave):
    """`ocp.args.PyTreeSave` for `MaxTextLayoutHandler` (so legacy ``save(path, item)`` works)."""


@ocp.args.register_with_handler(MaxTextLayoutHandler, for_restore=True)
@dataclasses.dataclass
class MaxTextLayoutRestore(ocp.args.PyTreeRestore):
    """`ocp.args.PyTreeRestore` plus the conversion options for Tunix-layout sources.

    Attributes (besides PyTreeRestore's ``item``, ``restore_args``, ``transforms``,
    ``partial_restore``, ...):
      optimizer: ``"convert"`` matches ``optimizer_state`` to ``item["opt_state"]``
        (the default when ``item`` has one); ``"drop"`` never reads it and the
        result has no ``opt_state`` even if ``item`` has one.
      ignore: glob patterns of ``model_params`` leaves to drop as intermediates.
    Both apply to Tunix-layout sources only; MaxText items restore the stock way.
    """

    optimizer: OptimizerMode | None = None
    ignore: tuple[str, ...] = ()


def tunix_step_of(directory: epath.PathLike, *, store: StepStore) -> epath.Path | None:
    """The Tunix step to convert for a restore of ``directory``, or None to restore stock.

    ``model_params`` is always Tunix; ``items`` and a bare step only when their step
    is in Tunix layout. ``optimizer_state`` and other items restore the stock way.
    """
    directory = epath.Path(directory)
    if directory.name == TUNIX_PARAMS_ITEM:
        return directory.parent
    if directory.name == MAXTEXT_ITEM or not store.exists(directory / METADATA_FILE):
        step_dir = step_dir_of(directory)
        if detect_layout(step_dir) is Layout.TUNIX:
            return step_dir
    return None


# -- load_params_from_path ----------------------------------------------------------------
@reads_only  # on an object store: each question asked of the store once (`reads_only`)
def load_params_from_path(
    load_parameters_from_path: epath.PathLike,
    abstract_unboxed_params: Any,
    checkpoint_storage_concurrent_gb: int = 96,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    *,
    enable_single_replica_ckpt_restoring: bool = False,
    handler: ocp.PyTreeCheckpointHandler | None = None,
    maxtext_config: Sequence[str] | None = None,
) -> Any:
    """Drop-in for MaxText's ``load_params_from_path`` that reads either layout, and a
    Hugging Face directory.

    The signature is MaxText 0.2.5's (``maxtext.common.checkpointing``) as its callers
    call it, plus ``handler``: the first five arguments positional or keyword alike,
    ``enable_single_replica_ckpt_restoring`` by keyword (every MaxText 0.2.5 caller passes
    it so; it is MaxText's sixth positional parameter, past this package's five).

    Args:
      load_parameters_from_path: a MaxText ``<step>/items``, a Tunix
        ``<step>/model_params`` (also an RL ``actor/<step>/model_params``), or a
        step directory of either layout.
      abstract_unboxed_params: MaxText's abstract params collection
        (``{"params": {...}}``, what ``items/params`` holds; a dict without the single
        ``params`` key is taken as its contents), or an NNX ``nnx.State`` of Params.
        Leaves carry the shardings to restore with (as for MaxText: none -> host
        arrays).
      checkpoint_storage_concurrent_gb, use_ocdbt, use_zarr3: as MaxText's; they
        configure the default handler.
      enable_single_replica_ckpt_restoring: accepted for MaxText's call; every host
        reads its own shards (no load-and-broadcast).
      handler: the handler to use; by default a `MaxTextLayoutHandler` built
        like MaxText's (the concurrency, OCDBT and zarr3 arguments apply only then).
      maxtext_config: MaxText's config (the file, then ``KEY=VALUE`` overrides) of the model,
        for a Hugging Face directory (``config.json`` and safetensors): its params are
        converted on read as ``import-hf`` writes them (`hf.import_hf.load_params`). The
        runner (``python -m orbax_maxtext_layout.maxtext``) passes its trainer's own.

    Returns:
      The restored params, of the kind given (dict, or an ``nnx.State`` copy).

    Raises:
      LayoutMismatchError: naming every requested weight that is missing or has
        another shape (metadata only; nothing is returned on a mismatch).
    """
    del enable_single_replica_ckpt_restoring  # a plain sharded restore on every host
    collection, rewrap = _as_collection(abstract_unboxed_params)
    if is_hf_dir(load_parameters_from_path):
        return rewrap(
            load_params(load_parameters_from_path, collection, maxtext_config=maxtext_config)
        )
    path = epath.Path(load_parameters_from_path)
    directory, layout = _resolve(path, store=store_for(path))
    if layout is Layout.MAXTEXT:
        _check_items(directory, collection)  # stock Orbax would not name the paths
    own = handler is None
    if handler is None:
        handler = MaxTextLayoutHandler(
            restore_concurrent_gb=checkpoint_storage_concurrent_gb,
            save_concurrent_gb=checkpoint_storage_concurrent_gb,
            use_ocdbt=use_ocdbt,
            use_zarr3=use_zarr3,
        )
    ckptr = ocp.Checkpointer(handler)
    try:
        # Exactly MaxText's call: `transforms={}` restores the params subtree only.
        restored = ckptr.restore(
            directory,
            item={"params": collection},
            transforms={},
            restore_args={"params": ocp.checkpoint_utils.construct_restore_args(collection)},
        )
    finally:
        if own:  # a caller's handler stays usable
            ckptr.close()
    return rewrap(restored["params"])


def _as_collection(abstract_params: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``abstract_params`` as the tree stored at ``items/params``, and the inverse for results."""
    from flax import nnx  # heavy; only needed for NNX targets

    if isinstance(abstract_params, nnx.State):

        def to_state(restored: Any) -> nnx.State:
            state = jax.tree.map(lambda x: x, abstract_params)  # a copy; input stays abstract
            nnx.replace_by_pure_dict(state, restored[PARAMS_ROOT[1]])
            return state

        return {PARAMS_ROOT[1]: abstract_params.to_pure_dict()}, to_state
    if isinstance(abstract_params, Mapping) and list(abstract_params) == [PARAMS_ROOT[1]]:
        return abstract_params, lambda r: r
    return {PARAMS_ROOT[1]: abstract_params}, lambda r: r[PARAMS_ROOT[1]]


def _resolve(path: epath.Path, *, store: StepStore) -> tuple[epath.Path, Layout]:
    """The directory to hand to the Checkpointer, and the layout it is in."""
    if path.name == TUNIX_PARAMS_ITEM:
        return path, Layout.TUNIX
    if path.name == MAXTEXT_ITEM and store.is_dir(path):
        return path, Layout.MAXTEXT
    step_dir = step_dir_of(path)
    layout = detect_layout(step_dir)
    if layout is Layout.MAXTEXT:
        return step_dir / MAXTEXT_ITEM, layout
    if layout is Layout.TUNIX:
        return step_dir / TUNIX_PARAMS_ITEM, layout
    if store.exists(path / METADATA_FILE):
        return path, Layout.MAXTEXT  # some other PyTree item: let Orbax read it
    raise CheckpointReadError(
        f"{path}: neither a MaxText items/ nor a Tunix model_params/ checkpoint."
    )


def _check_items(items_dir: epath.Path, collection: Any) -> None:
    """Names every requested weight an ``items`` checkpoint lacks or holds in another shape.

    Shapes only: for MaxText items Orbax casts dtypes as stock MaxText does.
    """
    have = read_specs(items_dir)
    problems = []
    for p, leaf in flatten(collection, is_leaf=_is_leaf).items():
        got = have.get(("params", *p))
        if leaf is ocp.PLACEHOLDER:
            continue
        want = spec_of(leaf)  # stored form: a typed key is compared as its uint32 data
        if got is None:
            problems.append(f"params/{keystr(p)}: expected by the target ({want}), missing")
        elif got.shape != want.shape:
            problems.append(f"params/{keystr(p)}: checkpoint has {got}, target expects {want}")
    if problems:
        raise LayoutMismatchError(
            f"{items_dir}: the params do not match the target ({len(problems)} offending paths):",
            problems,
            hint="Build the abstract params from the model config the checkpoint was saved with.",
        )
