"""Make MaxText 0.2.5 read Tunix-layout checkpoints: `install()`, and a runner.

``python -m orbax_maxtext_layout.maxtext MODULE ARGS...`` calls `install()` and then
runs ``MODULE`` as ``__main__`` with ``ARGS`` (MaxText's trainers, or any script that
calls them), e.g.::

    python -m orbax_maxtext_layout.maxtext maxtext.trainers.pre_train.train \\
        base.yml run_name=resume base_output_directory=gs://... load_parameters_path=...

A refusal of this library raised inside ``MODULE`` (an `OrbaxMaxTextLayoutError`, e.g. a
LoRA adapter step resumed as a model) is printed as the CLI prints it, one ``error:
<message>`` on stderr, and the runner exits 1; other exceptions keep their traceback.

`install()` changes two functions of ``maxtext.common.checkpointing``, and nothing else:

* ``create_orbax_checkpoint_manager`` builds `orbax_maxtext_layout.training.Checkpointer`
  (with exactly MaxText's arguments) instead of Orbax's ``ocp.training.Checkpointer``, so
  MaxText's own resume (``load_state_if_possible``) lists and restores a Tunix run's
  steps, and its saves migrate them;
* ``load_params_from_path`` reads a Tunix-layout path (``<step>/model_params``, or a
  Tunix step) through this package, and a Hugging Face directory (``config.json`` and
  safetensors: ``load_parameters_path=HF_DIR``), converted on read for the trainer's own
  config as ``import-hf`` writes it; every other path goes to MaxText's own function.

`target_from_config(argv)` builds the `Target` MaxText's own pre-training loop restores, from
MaxText's own config (the arguments its commands take), with MaxText's own code.

This module is the only one in the package that imports MaxText, and only in `install()` and
`target_from_config()`.
"""

from __future__ import annotations

import logging
import runpy
import sys
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from etils import epath

from .errors import OrbaxMaxTextLayoutError, print_error
from .hf.import_hf import is_hf_dir
from .orbax_io.layout import MAXTEXT_ITEM, Layout, detect_layout, step_dir_of

if TYPE_CHECKING:
    pass

__all__ = ["install", "main", "run"]

logger = logging.getLogger(__name__)
_MARK = "_orbax_maxtext_layout_original"
# The trainer's own arguments (its config file, then KEY=VALUE), set by `run`: the model a
# Hugging Face ``load_parameters_path`` is converted for.
RUN_ARGS: list[str] = []


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
    from .integration.handler import load_params_from_path as ours

    def load_params_from_path(load_parameters_from_path: Any, *args: Any, **kwargs: Any) -> Any:
        if is_hf_dir(load_parameters_from_path):  # converted on read, with the run's config
            return ours(load_parameters_from_path, *args, maxtext_config=RUN_ARGS, **kwargs)
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
    run(module, rest)


def run(module: str, args: Sequence[str]) -> None:
    """Runs ``module`` as ``__main__`` with ``args`` (`main`'s work once MaxText is patched).

    A refusal of this library (an `OrbaxMaxTextLayoutError`, e.g. a LoRA adapter step asked
    for as a model) is printed as the CLI prints it, one ``error: <message>`` on stderr, and
    the process exits 1; any other exception keeps its traceback.
    """
    sys.argv = [module, *args]
    RUN_ARGS[:] = list(args)  # the trainer's config, for a Hugging Face load_parameters_path
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except OrbaxMaxTextLayoutError as e:
        print_error(e)
        sys.exit(1)


if __name__ == "__main__":
    # Under ``python -m`` this file runs as ``__main__``: a second copy of the module. The
    # functions install() puts into MaxText must belong to the one copy importable by name
    # (``orbax_maxtext_layout.maxtext``, ``__spec__.name``), so the runner calls its main().
    import importlib

    from orbax_maxtext_layout.base.gcfreeze import freeze_for_exit

    try:
        importlib.import_module(__spec__.name).main()
    finally:  # the trainer returned or exited (absl's app.run raises SystemExit)
        freeze_for_exit()
