"""Read MaxText 0.2.5's config the way its own train loop does: the abstract target of a run.

`abstract_items` builds, with MaxText's own code, the abstract ``TrainStateNNX`` its
pre-training loop restores, in its on-disk form; `Target.from_maxtext_config` (CLI
``--maxtext-config``) splits against it. Besides `maxtext` (which patches MaxText), this is
the only module that imports MaxText, and only when called: MaxText is not a dependency.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import types
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import UsageError

MAXTEXT_PRNG_IMPL = "unsafe_rbg"


def abstract_items(argv: Sequence[str]) -> Any:
    """The abstract items MaxText's pre-training loop restores (`abstract_model`'s items)."""
    return abstract_model(argv)[0]


def abstract_model(argv: Sequence[str]) -> tuple[Any, dict[tuple[str, ...], int]]:
    """The abstract items MaxText's pre-training loop restores, built by MaxText 0.2.5 from
    its config (`Target.from_maxtext_config` makes the `Target` of them), and the layer axis
    of every scanned weight: ``{model path: param_scan_axis}``, the metadata MaxText's scan
    (``nnx_scan.create_scanned_layers``) gives each stacked Param, which the on-disk form
    does not keep.

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
    to its restore.

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
                return _train_state_items(mt, config)
            except Exception as e:
                raise UsageError(
                    f"MaxText cannot build the model and optimizer of {' '.join(args)}: "
                    f"{type(e).__name__}: {e}"
                ) from e


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

    # JAX's context form of the option: this thread only, not the process's setting (a
    # trainer's other threads never see it; issue 57).
    with jax.default_prng_impl(MAXTEXT_PRNG_IMPL):
        yield


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


def _train_state_items(
    mt: types.SimpleNamespace, config: Any
) -> tuple[Any, dict[tuple[str, ...], int]]:
    """The abstract ``TrainStateNNX`` of ``train_utils.setup_train_loop``, in its on-disk
    form, and its scanned Params' ``param_scan_axis`` metadata."""
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
    return mt.train_state_nnx.to_checkpoint_dict(abstract), _scan_axes(abstract)


def _scan_axes(abstract: Any) -> dict[tuple[str, ...], int]:
    from flax import nnx

    state = nnx.state(abstract) if isinstance(abstract, nnx.Module) else abstract
    out = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        if path[:1] == ("model",) and isinstance(var, nnx.Param) and "param_scan_axis" in meta:
            out[tuple(str(k) for k in path[1:])] = int(meta["param_scan_axis"])
    return out
