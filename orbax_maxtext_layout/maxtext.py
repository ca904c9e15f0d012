"""Make MaxText 0.2.5 read Tunix-layout checkpoints: `install()`, and a runner.

``python -m orbax_maxtext_layout.maxtext MODULE ARGS...`` calls `install()` and then
runs ``MODULE`` as ``__main__`` with ``ARGS`` (MaxText's trainers, or any script that
calls them), e.g.::

    python -m orbax_maxtext_layout.maxtext maxtext.trainers.pre_train.train \\
        base.yml run_name=resume base_output_directory=gs://... load_parameters_path=...

`install()` changes two functions of ``maxtext.common.checkpointing``, and nothing else:

* ``create_orbax_checkpoint_manager`` builds `orbax_maxtext_layout.training.Checkpointer`
  (with exactly MaxText's arguments) instead of Orbax's ``ocp.training.Checkpointer``, so
  MaxText's own resume (``load_state_if_possible``) lists and restores a Tunix run's
  steps, and its saves migrate them;
* ``load_params_from_path`` reads a Tunix-layout path (``<step>/model_params``, or a
  Tunix step) through this package; every other path goes to MaxText's own function.

`target_from_config(argv)` builds the `Target` MaxText's own pre-training loop restores, from
MaxText's own config (the arguments its commands take), with MaxText's own code.

This module is the only one in the package that imports MaxText, and only in `install()` and
`target_from_config()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from etils import epath

from .errors import UsageError
from .layout import MAXTEXT_ITEM, Layout, detect_layout, step_dir_of

if TYPE_CHECKING:
    from .target import Target

__all__ = ["install", "main", "target_from_config"]

logger = logging.getLogger(__name__)
_MARK = "_orbax_maxtext_layout_original"


def install() -> None:
    """Makes this process's MaxText read Tunix-layout checkpoints (see the module docstring).

    Idempotent. Raises ImportError if MaxText cannot be imported.
    """
    try:
        from maxtext.common import checkpointing
    except ImportError as e:
        raise ImportError(
            "orbax_maxtext_layout.maxtext.install() patches MaxText, which cannot be imported "
            f"here ({e}). Install maxtext 0.2.5 (Python 3.12) in this environment, or use the "
            "v1 Checkpointer directly: orbax_maxtext_layout.training.Checkpointer."
        ) from e
    create = checkpointing.create_orbax_checkpoint_manager
    load = checkpointing.load_params_from_path
    if hasattr(create, _MARK) and hasattr(load, _MARK):
        return
    checkpointing.create_orbax_checkpoint_manager = _building_our_checkpointer(
        checkpointing, create
    )
    checkpointing.load_params_from_path = _reading_tunix_paths(load)
    logger.info(
        "orbax_maxtext_layout: maxtext.common.checkpointing.create_orbax_checkpoint_manager now "
        "builds orbax_maxtext_layout.training.Checkpointer, and load_params_from_path reads "
        "Tunix-layout paths (model_params) through orbax_maxtext_layout."
    )


def _building_our_checkpointer(checkpointing: types.ModuleType, create: Callable) -> Callable:
    """MaxText's own ``create_orbax_checkpoint_manager``, building our Checkpointer.

    It runs MaxText's function unchanged with its module's ``ocp`` (Orbax v1) seen
    through a view whose ``training.Checkpointer`` is ours, for the duration of the call.
    """
    from .training import Checkpointer

    def create_orbax_checkpoint_manager(*args: Any, **kwargs: Any) -> Any:
        v1 = checkpointing.ocp
        checkpointing.ocp = _View(v1, training=_View(v1.training, Checkpointer=Checkpointer))
        try:
            return create(*args, **kwargs)
        finally:
            checkpointing.ocp = v1

    setattr(create_orbax_checkpoint_manager, _MARK, create)
    create_orbax_checkpoint_manager.__doc__ = create.__doc__
    return create_orbax_checkpoint_manager


def _reading_tunix_paths(load: Callable) -> Callable:
    from .handler import load_params_from_path as ours

    def load_params_from_path(load_parameters_from_path: Any, *args: Any, **kwargs: Any) -> Any:
        fn = ours if is_tunix_path(load_parameters_from_path) else load
        return fn(load_parameters_from_path, *args, **kwargs)

    setattr(load_params_from_path, _MARK, load)
    load_params_from_path.__doc__ = load.__doc__
    return load_params_from_path


def is_tunix_path(path: epath.PathLike) -> bool:
    """A ``model_params`` item, or a path of a step (or its ``items``) in Tunix layout."""
    path = epath.Path(str(path).rstrip("/"))
    if path.name == "model_params":
        return True
    step = path.parent if path.name == MAXTEXT_ITEM else step_dir_of(path)
    return detect_layout(step) is Layout.TUNIX


class _View(types.SimpleNamespace):
    """A module seen with some attributes replaced."""

    def __init__(self, inner: Any, **replaced: Any) -> None:
        super().__init__(**replaced)
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# MaxText 0.2.5's pre-training main (``trainers/pre_train/train.py``, ``initialize``) sets
# ``jax_default_prng_impl`` to this before anything else: its RNG state holds these keys.
MAXTEXT_PRNG_IMPL = "unsafe_rbg"


def target_from_config(argv: Sequence[str]) -> Target:
    """The `Target` MaxText's pre-training loop restores, built by MaxText 0.2.5 from its config.

    ``argv`` is what follows the program in a MaxText command: the config file, then its
    ``KEY=VALUE`` overrides, e.g. ``[".../configs/base.yml", "model_name=llama3.1-8b",
    "scan_layers=true"]``; MaxText finds the config file (a path, or
    ``src/maxtext/configs/...`` in the installed package). The steps are MaxText's own, as
    ``train.py`` and ``train_utils.setup_train_loop`` take them: the config from ``pyconfig``;
    the mesh (``maxtext_utils.get_mesh_from_config``); the abstract model
    (``model_creation_utils.create_nnx_abstract_model``) and the optimizer
    (``train_utils.create_training_optimizer``) in a ``TrainStateNNX``, made abstract by
    ``maxtext_utils.get_abstract_state`` (``nnx.eval_shape``: shapes, dtypes and shardings,
    no weights); its on-disk form ``train_state_nnx.to_checkpoint_dict``, what MaxText passes
    to its restore; then `Target.from_items`.

    Side effects are contained: ``jax_default_prng_impl`` is ``unsafe_rbg`` (as ``train.py``
    sets it) only during the call; ``base_output_directory`` (MaxText's default is
    ``./maxtext_output``, a given one is replaced) is a temporary directory, removed
    afterwards; the JAX distributed system is not initialized (``skip_jax_distributed_system``;
    these two are not overridden where MaxText's ``M_<KEY>`` environment variable sets them);
    what MaxText prints goes to stderr. The mesh is built on this process's JAX devices, as
    MaxText builds it: a config whose parallelism needs more devices fails (override its
    ``ici_*``/``dcn_*`` keys); the CLI runs this on CPU unless ``JAX_PLATFORMS`` is set.

    Raises ImportError (naming what to install) where MaxText cannot be imported, and
    `UsageError` where MaxText rejects the config or cannot build its model, and for
    ``lora.enable_lora=true`` (MaxText checkpoints only the adapters of a LoRA run; pass the
    base model's config).
    """
    args = [argv] if isinstance(argv, str) else [str(a) for a in argv]
    if not args:
        raise UsageError(
            "MaxText's config is needed: the config file (e.g. .../maxtext/configs/base.yml), "
            "then its KEY=VALUE overrides."
        )
    mt = _maxtext_for_config()
    from .target import Target

    with contextlib.redirect_stdout(sys.stderr), _maxtext_prng():
        with tempfile.TemporaryDirectory(prefix="orbax-maxtext-layout-config-") as scratch:
            try:
                config = _maxtext_config(mt.pyconfig, args, scratch)
            except Exception as e:
                raise UsageError(
                    f"MaxText rejects the config {' '.join(args)}: {type(e).__name__}: {e}"
                ) from e
            if getattr(getattr(config, "lora", None), "enable_lora", False):
                raise UsageError(
                    "lora.enable_lora=true: MaxText checkpoints only the adapters of a LoRA run. "
                    "Pass the base model's config (without lora.enable_lora); merge adapters "
                    "with merge-lora."
                )
            try:
                items = _train_state_items(mt, config)
            except Exception as e:
                raise UsageError(
                    f"MaxText cannot build the model and optimizer of {' '.join(args)}: "
                    f"{type(e).__name__}: {e}"
                ) from e
    return Target.from_items(items)


def _maxtext_for_config() -> types.SimpleNamespace:
    try:
        with contextlib.redirect_stdout(sys.stderr):  # MaxText prints notes when imported
            from maxtext.common import train_state_nnx
            from maxtext.configs import pyconfig
            from maxtext.utils import maxtext_utils, model_creation_utils, train_utils
    except ImportError as e:
        raise ImportError(
            "a target from MaxText's config is built by MaxText, which cannot be imported here "
            f"({e}). Install maxtext 0.2.5 (it needs Python 3.12) in this environment, or pass "
            "a MaxText checkpoint of the same model instead (--target-from DIR, "
            "Target.from_checkpoint)."
        ) from e
    return types.SimpleNamespace(
        pyconfig=pyconfig,
        maxtext_utils=maxtext_utils,
        model_creation_utils=model_creation_utils,
        train_utils=train_utils,
        train_state_nnx=train_state_nnx,
    )


@contextlib.contextmanager
def _maxtext_prng() -> Iterator[None]:
    import jax

    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", MAXTEXT_PRNG_IMPL)
    try:
        yield
    finally:
        jax.config.update("jax_default_prng_impl", previous)


def _maxtext_config(pyconfig: Any, args: list[str], scratch: str) -> Any:
    """``pyconfig.initialize(["", *args])``, as MaxText's pre-training main reads its config.

    Called without ``initialize``'s error handler, which writes ``/dev/termination-log`` and
    exits the process (outside pytest): here a rejected config is an exception.
    """
    own = {
        "base_output_directory": os.path.join(scratch, "maxtext_output"),
        "skip_jax_distributed_system": True,
    }
    kwargs = {k: v for k, v in own.items() if pyconfig.yaml_key_to_env_key(k) not in os.environ}
    return pyconfig.HyperParameters(pyconfig._initialize_pydantic(["", *args], **kwargs))


def _train_state_items(mt: types.SimpleNamespace, config: Any) -> Any:
    """The abstract ``TrainStateNNX`` of ``train_utils.setup_train_loop``, in its on-disk form."""
    from flax import nnx

    mesh = mt.maxtext_utils.get_mesh_from_config(config)
    create_model, model = mt.model_creation_utils.create_nnx_abstract_model(config, mesh)
    _, tx = mt.train_utils.create_training_optimizer(config, model, mesh=mesh)

    def create_train_state_fn() -> Any:  # setup_train_loop's, without LoRA (refused above)
        model = create_model()
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        return mt.train_state_nnx.TrainStateNNX(model, optimizer)

    abstract, _, _ = mt.maxtext_utils.get_abstract_state(
        config, mesh, create_train_state_fn, is_training=True
    )
    return mt.train_state_nnx.to_checkpoint_dict(abstract)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m orbax_maxtext_layout.maxtext MODULE ARGS...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(0 if argv else 2)
    install()
    print(
        "orbax_maxtext_layout: MaxText reads Tunix-layout checkpoints in this run "
        "(create_orbax_checkpoint_manager, load_params_from_path).",
        file=sys.stderr,
    )
    module, *rest = argv
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Under ``python -m`` this file runs as ``__main__``: a second copy of the module. The
    # functions install() puts into MaxText must belong to the one copy importable by name
    # (``orbax_maxtext_layout.maxtext``, ``__spec__.name``), so the runner calls its main().
    import importlib

    importlib.import_module(__spec__.name).main()
