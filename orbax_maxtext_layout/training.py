"""`Checkpointer`: Orbax's v1 training Checkpointer, reading Tunix-layout steps as MaxText ones.

MaxText 0.2.5 checkpoints through ``ocp.training.Checkpointer`` (``from orbax.checkpoint
import v1 as ocp``): `create_orbax_checkpoint_manager` builds one, and
`load_state_if_possible` requires one and calls ``latest``, ``checkpoints`` and
``load_checkpointables(step, {"items": <abstract items>})`` under a context with
``partial_load=True``. This subclass is a drop-in for it (same constructor, plus
``migrate`` and ``remove_legacy``) with the semantics of the v0 `CheckpointManager` of
this package, which it reuses: the v1 Checkpointer keeps a v0 ``CheckpointManager``
inside and lists, saves, deletes and waits through it, and here that inner manager *is*
`orbax_maxtext_layout.CheckpointManager` (with MaxText's numbering), built with the options
the stock v1 constructor derives from its arguments and context (`_v0_options`, derived
here the same way: no stock manager is built, read or closed). So:

- a Tunix-layout step (``<dir>/<N>/model_params``, no ``items/``) is listed as MaxText
  step ``N - 1`` in ``checkpoints``, ``latest`` and ``should_save`` (Tunix directory
  ``0`` is not listed), and its ``CheckpointMetadata.path``, ``metadata`` and
  ``checkpointables_metadata`` name the directory it is in;
- ``load_checkpointables(step, {"items": abstract})``, ``load(step, abstract,
  checkpointable_name="items")`` and ``load_pytree`` read it as MaxText items, converted
  against ``abstract`` and placed with its leaves' shardings (`restore.RestoreRequest`);
  the context's ``partial_load`` makes it a partial restore (a params-only request reads
  only the weights). Other requested checkpointables (e.g. ``iter``) load the stock v1
  way if the step holds them, else come back as ``None`` with a warning, as in the v0
  manager. ``load`` of a checkpointable the step lacks raises ``KeyError``, as stock v1
  does; without an abstract tree the step loads as stored, with a warning;
- the first save at directory ``N`` moves the legacy step to ``N - 1`` first, and once
  that save has committed (in Orbax's save-finalize thread: v1 saves are always
  asynchronous underneath, so ``save_checkpointables_async`` returns before the
  migration runs) a restored step is rewritten into MaxText's layout;
- MaxText-layout steps, saves, deletes, ``wait``, ``close`` and ``reload`` are stock.

Orbax private names used (each pinned by tests/test_training.py, which fails when Orbax
changes it): the attributes the stock v1 constructor sets, which this constructor sets in
its place, ``_context``, ``_step_name_format`` (wrapped, so a legacy step's paths name the
directory it is in), ``_manager`` (ours; every v1 operation goes through it, and
``checkpoints`` reads its ``_checkpoints``) and, where the stock one sets them,
``_logger`` and ``_pending_delete``; the private modules' ``context.Context``/
``get_context`` (the context v1 runs its own loads in, for ``partial_load``) and
``path.step.standard_name_format`` (v1's default step names). The test also pins that the v0
options derived here equal what the stock constructor derives, for several arguments and
contexts.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.experimental import v1 as ocp1

# Private: the function v1's own loads use to pick the active context (see above).
from orbax.checkpoint.experimental.v1._src.context import context as context_lib
from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler as v1_pytree
from orbax.checkpoint.experimental.v1._src.path import step as path_step_lib

from .base.step_entries import MAXTEXT_ITEM
from .errors import UsageError
from .execute.restore import restore_pytree
from .integration.legacy_steps import LegacySteps, check_migrate, load_requested
from .integration.manager import CheckpointManager

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

# v1's default checkpointable name for load/save ("state" in Orbax 0.12.8).
STATE_CHECKPOINTABLE_KEY = (
    inspect.signature(ocp1.training.Checkpointer.load).parameters["checkpointable_name"].default
)


# orbax-checkpoint >= 0.12.8: the v1 constructor takes a logger (kept as ``_logger``), deletes
# in the foreground and keeps a pending delete; older ones do neither.
_TAKES_LOGGER = "logger" in inspect.signature(ocp1.training.Checkpointer.__init__).parameters


def _v0_options(
    context: ocp1.Context,
    save_decision_policy: Any,
    preservation_policy: Any,
    step_name_format: Any,
    **flags: bool,
) -> ocp.CheckpointManagerOptions:
    """The v0 manager's options, as the stock v1 constructor derives them from its
    arguments and ``context``; ``flags``: ``cleanup_tmp_directories``,
    ``lightweight_initialize``."""
    policies = ocp1.training.save_decision_policies
    save_decision_policy = save_decision_policy or policies.AnySavePolicy(
        [
            policies.InitialSavePolicy(),
            policies.ContinuousCheckpointingPolicy(),
            policies.PreemptionCheckpointingPolicy(),
        ]
    )
    preservation = preservation_policy or ocp1.training.preservation_policies.PreserveAll()
    extra = {"enable_background_delete": False} if _TAKES_LOGGER else {}
    return ocp.CheckpointManagerOptions(
        save_decision_policy=save_decision_policy,
        preservation_policy=preservation,
        step_name_format=step_name_format,
        max_to_keep=None,  # unlimited: the preservation policy decides
        todelete_full_path=context.deletion_options.gcs_deletion_options.todelete_full_path,
        async_options=context.async_options.v0(),
        file_options=context.file_options.v0(),
        multiprocessing_options=context.multiprocessing_options.v0(),
        atomicity_options=context.atomicity.v0(),
        prevent_write_metrics=True,  # the v1 Checkpointer writes the metrics
        **extra,
        **flags,
    )


class Checkpointer(ocp1.training.Checkpointer):
    """``ocp.training.Checkpointer`` that also reads Tunix-layout steps (see the module
    docstring).

    Args:
      directory, context, save_decision_policy, preservation_policy, step_name_format,
        custom_metadata, cleanup_tmp_directories, lightweight_initialize, logger,
        **kwargs: exactly ``ocp.training.Checkpointer``'s.
      migrate: "on_save" rewrites each restored legacy step into MaxText's layout after
        the next committed save; "off" never rewrites (moves still happen).
      remove_legacy: delete a migrated step's ``model_params``/``optimizer_state`` once
        its new ``items`` has been verified against them.
    """

    def __init__(
        self,
        directory: epath.PathLike,
        *,
        context: ocp1.Context | None = None,
        save_decision_policy: Any = None,
        preservation_policy: Any = None,
        step_name_format: Any = None,
        custom_metadata: Any = None,
        cleanup_tmp_directories: bool = False,
        lightweight_initialize: bool = False,
        logger: Any = None,
        migrate: Literal["on_save", "off"] = "on_save",
        remove_legacy: bool = False,
        **kwargs: Any,
    ) -> None:
        check_migrate(migrate)
        if kwargs:  # as the stock constructor refuses them
            raise TypeError(f"Checkpointer() got unexpected keyword arguments {sorted(kwargs)}")
        # The stock constructor is not called: it would build (and list the directory with) a
        # stock v0 manager. This sets what it sets, with our manager as the inner one.
        self._context = context_lib.Context(context or context_lib.get_context())
        logger = logger or ocp.logging.StandardLogger()  # one logger for v1 and v0, as stock
        if _TAKES_LOGGER:
            self._logger = logger
        options = _v0_options(
            self._context,
            save_decision_policy,
            preservation_policy,
            step_name_format,
            cleanup_tmp_directories=cleanup_tmp_directories,
            lightweight_initialize=lightweight_initialize,
        )
        self._manager = CheckpointManager(
            directory,
            options=options,
            metadata=custom_metadata,
            logger=logger,
            migrate=migrate,
            remove_legacy=remove_legacy,
            numbering="maxtext",  # the v1 Checkpointer's callers are MaxText's
        )
        if _TAKES_LOGGER:
            self._pending_delete = None
        names = step_name_format or path_step_lib.standard_name_format()
        self._step_name_format = _WhereTheStepIs(names, self._manager.legacy_steps)

    # -- loading -----------------------------------------------------------------------
    def load_checkpointables(
        self,
        step: int | ocp1.training.CheckpointMetadata | None = None,
        abstract_checkpointables: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Stock v1 ``load_checkpointables``; a Tunix-layout step's ``items`` come back as
        MaxText items, converted against (and placed like) the abstract tree given."""
        number = self._number(step)
        held = None if number is None else self._held(number)
        if held is None:
            native = self._load_native(number, abstract_checkpointables)
            if native is not None:
                return native
            return super().load_checkpointables(step, abstract_checkpointables)
        assert number is not None
        context = context_lib.get_context(self._context)
        with context:
            if abstract_checkpointables is None:
                logger.warning(
                    "Step %d (%s) is in Tunix layout and load_checkpointables() got no "
                    "abstract tree, so it cannot be split into MaxText items (only the model "
                    "tells weights from RNG state): loading it as stored. Pass "
                    "{'items': <abstract items>} for MaxText items (and migration).",
                    number,
                    held,
                )
                return ocp1.load_checkpointables(held)
            return load_requested(
                number,
                held,
                abstract_checkpointables,
                lambda abstract: self._load_items(number, held, abstract, context),
                lambda stock: ocp1.load_checkpointables(held, stock),
                kind="checkpointable",
                log=logger,
            )

    def load(
        self,
        step: int | ocp1.training.CheckpointMetadata | None = None,
        abstract_state: Any = None,
        *,
        checkpointable_name: str = STATE_CHECKPOINTABLE_KEY,
    ) -> Any:
        """Stock v1 ``load``; MaxText's items of any step load with
        ``checkpointable_name="items"``."""
        number = self._number(step)
        held = None if number is None else self._held(number)
        if (
            held is not None
            and checkpointable_name != MAXTEXT_ITEM
            and not (held / checkpointable_name).exists()
        ):
            raise KeyError(
                f"Step {number} ({held}) is in Tunix layout and has no {checkpointable_name!r} "
                f"checkpointable. MaxText's state loads with checkpointable_name="
                f"{MAXTEXT_ITEM!r} and an abstract items tree."
            )
        return super().load(step, abstract_state, checkpointable_name=checkpointable_name)

    def _load_native(self, number: int | None, abstract: dict[str, Any] | None) -> Any:
        """A MaxText step's ``items`` loaded as stock v1 loads them, its arrays through the
        restore engine (`restore_pytree`, with v1's own restore args and v1's PyTree handler
        for the rest); the other checkpointables the stock way. None: all the stock way."""
        if number is None or not abstract or abstract.get(MAXTEXT_ITEM) is None:
            return None
        step_dir = self.directory / self._step_name_format.build_name(number)
        items_dir = step_dir / MAXTEXT_ITEM
        if not (items_dir / "_METADATA").exists():
            return None
        context = context_lib.get_context(self._context)
        with context:
            handler = v1_pytree.PyTreeHandler(context=context)
            args = v1_pytree.create_v0_restore_args(context, abstract[MAXTEXT_ITEM])

            def stock(d: epath.Path, a: Any) -> Any:
                return handler._handler_impl.restore(d, args=a)  # v1's own load, as it runs it

            items = restore_pytree(items_dir, args, stock)
        others = {k: v for k, v in abstract.items() if k != MAXTEXT_ITEM}
        out = dict(super().load_checkpointables(number, others)) if others else {}
        out[MAXTEXT_ITEM] = items
        return out

    def _load_items(self, step: int, held: epath.Path, abstract: Any, context: Any) -> Any:
        if abstract is None:
            raise UsageError(
                f"Step {step} ({held}) is in Tunix layout. Loading it as MaxText items needs "
                f"the abstract target: load_checkpointables(step, {{{MAXTEXT_ITEM!r}: "
                "<abstract items>})."
            )
        partial = bool(context.pytree_options.loading.partial_load)
        return self._manager.legacy_steps.restore_items(step, held, abstract, partial=partial)

    def _held(self, number: int) -> epath.Path | None:
        """Where legacy step ``number`` is, decided alike on every process (`LegacySteps.held_everywhere`)."""
        return self._manager.legacy_steps.held_everywhere(number, self._manager.wait_until_finished)

    def _number(self, step: int | ocp1.training.CheckpointMetadata | None) -> int | None:
        if step is None:
            latest = self.latest
            return None if latest is None else latest.step
        return step.step if isinstance(step, ocp1.training.CheckpointMetadata) else int(step)

    # -- deleting ----------------------------------------------------------------------
    def delete_async(
        self,
        step: int | ocp1.training.CheckpointMetadata,
        *,
        checkpointable_name: str | None = None,
        missing_ok: bool = False,
    ) -> ocp1.AsyncResponse[bool]:
        # v1 deletes ``<dir>/<step>`` through the v0 deleter, which finds steps by their
        # own number: a legacy step is moved there first (as the v0 manager's delete does).
        number = step.step if isinstance(step, ocp1.training.CheckpointMetadata) else step
        legacy = self._manager.legacy_steps
        if isinstance(number, int) and legacy.held(number) is not None:
            self._manager.wait_until_finished()
            legacy.release(number, forget=checkpointable_name is None)
            if jax.process_count() > 1:  # the primary moved it; every process checks the path
                ocp.multihost.sync_global_processes(f"orbax_maxtext_layout_delete_{number}")
        return super().delete_async(
            step, checkpointable_name=checkpointable_name, missing_ok=missing_ok
        )


class _WhereTheStepIs:
    """v1's step name format, naming the directory a listed legacy step is in now.

    v1 builds a step's path as ``directory / build_name(step)`` for ``checkpoints``,
    ``metadata``, ``checkpointables_metadata`` and deletes; a legacy step presented as
    ``N - 1`` lives in ``N`` until a save moves it.
    """

    def __init__(self, inner: Any, legacy: LegacySteps) -> None:
        self._inner = inner
        self._legacy = legacy

    def build_name(self, step: int) -> str:
        held = self._legacy.where(step)
        return self._inner.build_name(step) if held is None else held.name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
