"""MaxText 0.2.5's own Hugging Face mapping, read per layer: what `export_hf` writes.

MaxText's ``to_huggingface`` restores a whole model, then feeds each MaxText param
(``params-decoder-layers-mlp-wi_0-kernel``) through ``process_maxtext_param``: a scanned
param is sliced on its layer axis, each slice goes through the model's hook functions
(transposes, reshapes, the query scaling) to its Hugging Face tensor, cast to
``weight_dtype``. The mapping, the hooks, the HF shapes and configs are MaxText's
(``maxtext.checkpoint_conversion.utils``: ``PARAM_MAPPING``, ``HOOK_FNS``, ``HF_SHAPE``,
``HF_MODEL_CONFIGS``, and ``to_huggingface``'s ``_get_model_mappings`` and
``_validate_or_update_architecture``), called here, not rewritten. What differs is the
unit of work: one `Unit` is one slice (one layer of one param), so an export holds a
few slices, never the model. Every unit's output shape is known from MaxText's shape map
before any byte is read, and checked against the step's metadata by tracing the hooks
(`check_units`).

This module imports MaxText (only when called); MaxText is not a dependency.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import LayoutMismatchError, UsageError

INSTALL_HINT = (
    "export-hf runs MaxText's own mappings: install maxtext 0.2.5 (Python 3.12) beside this "
    "package (pip install 'orbax-maxtext-layout[maxtext]')."
)


class MaxTextMissing(UsageError):
    """MaxText (or its converter's dependencies) cannot be imported here."""


@dataclasses.dataclass(frozen=True)
class HfModel:
    """A MaxText config with its Hugging Face mapping (what `load_model` builds)."""

    config: Any  # MaxText's pydantic config, as to_huggingface reads it
    hf_config: Any  # transformers config, a private copy, sizes overridden when asked
    param_map: dict
    shape_map: dict
    hook_map: dict
    weight_dtype: np.dtype

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def scan_layers(self) -> bool:
        return bool(self.config.scan_layers)


@dataclasses.dataclass(frozen=True)
class Unit:
    """One slice of work: layer ``index`` (on ``axis``) of the MaxText params ``keys``
    (one key, or a composite MaxText key fused into one HF tensor), to ``hf_path``: a
    name, or a tuple of names a hook splits into. ``index`` None: the whole param. A param
    stacked on several axes (a scanned MoE param: experts and layers) is cut on each in
    turn, as ``process_maxtext_param`` cuts it (``more``)."""

    keys: tuple[str, ...]
    index: int | None
    axis: int | None
    hf_path: Any
    hooks: Any
    # further (axis, index) slices after the first, each on the array the one before left
    # (a scanned MoE param, stacked on its expert and layer axes)
    more: tuple[tuple[int, int], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(_flat_names(self.hf_path))

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """Every ``(axis, index)`` slice that makes the unit's slice, in order."""
        if self.index is None or self.axis is None:
            return ()
        return ((self.axis, self.index), *self.more)

    def slice_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        out = tuple(shape)
        for a, _ in self.levels:
            out = out[:a] + out[a + 1 :]
        return out

    def take_more(self, x: Any) -> Any:
        """The unit's slice of ``x``, already cut on its first stacked axis (a view)."""
        for a, i in self.more:
            x = x[(slice(None),) * a + (i,)]
        return x


def _flat_names(p: Any) -> list[str]:
    if isinstance(p, str):
        return [p]
    return [n for q in p for n in _flat_names(q)]


# -- MaxText -------------------------------------------------------------------------------
def _maxtext() -> Any:
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import maxtext.checkpoint_conversion.to_huggingface as th
            from maxtext.checkpoint_conversion.utils import utils as mu
            from maxtext.configs import pyconfig
            from maxtext.utils.globals import HF_IDS
    except ImportError as e:
        raise MaxTextMissing(f"MaxText cannot be imported here ({e}). {INSTALL_HINT}") from e
    return th, mu, pyconfig, HF_IDS


def supported_models() -> list[str]:
    """The model names MaxText 0.2.5 can export (a mapping, shapes, hooks and HF config)."""
    th, _, _, hf_ids = _maxtext()
    return sorted(
        set(th.PARAM_MAPPING)
        & set(th.HF_SHAPE)
        & set(th.HOOK_FNS)
        & set(th.HF_MODEL_CONFIGS)
        & set(hf_ids)
    )


def with_scan_layers(argv: list[str], scanned: bool | None, where: Any) -> list[str]:
    """``argv`` with the ``scan_layers`` of the stored form (None: unknown, unchanged), as
    MaxText's ``verify_and_sync_scan_layers`` syncs it; a conflicting explicit value is
    refused, naming ``where`` the params are stored."""
    given = [a for a in argv if a.split("=", 1)[0] == "scan_layers"]
    if scanned is None:
        return argv
    if given:
        value = given[-1].split("=", 1)[1].strip().lower() in ("true", "1")
        if value != scanned:
            raise UsageError(
                f"{where}: the params are stored {'scanned' if scanned else 'unscanned'}, but "
                f"the config says {given[-1]}: drop the key (it is read from the step) or "
                f"export the {'--unroll' if value is False else '--stack'} form of the step."
            )
        return argv
    return [*argv, f"scan_layers={str(scanned).lower()}"]


def hf_id(model_name: str) -> str:
    """MaxText's Hugging Face model id of ``model_name`` (its ``HF_IDS``)."""
    _, _, _, ids = _maxtext()
    return ids[model_name]


def load_config(argv: Sequence[str]) -> Any:
    """MaxText's pydantic config of ``argv`` (the config file, then KEY=VALUE overrides),
    as ``to_huggingface`` reads it, without its process-exiting error handler."""
    _, _, pyconfig, _ = _maxtext()
    args = [str(a) for a in argv]
    if not args:
        raise UsageError("--maxtext-config needs the config file (e.g. .../configs/base.yml).")
    with tempfile.TemporaryDirectory(prefix="orbax-maxtext-layout-export-") as scratch:
        own = {
            "base_output_directory": os.path.join(scratch, "out"),
            "skip_jax_distributed_system": True,
        }
        kw = {k: v for k, v in own.items() if pyconfig.yaml_key_to_env_key(k) not in os.environ}
        try:
            with contextlib.redirect_stdout(sys.stderr):
                return pyconfig._initialize_pydantic(["", *args], **kw)
        except Exception as e:
            raise UsageError(
                f"MaxText rejects the config {' '.join(args)}: {type(e).__name__}: {e}"
            ) from e


def lora_settings(config: Any) -> tuple[int, float, str]:
    """``(lora_rank, lora_alpha, module path)`` of a MaxText config's ``lora`` keys, the
    module path as MaxText's ``train_sft`` resolves it (``lora_utils._get_lora_module_path``:
    ``lora.lora_module_path``, else the family's from ``lora_module_path.yml``, its layer
    level made to match scanned and unscanned paths); qwix fullmatches it per module."""
    lora = getattr(config, "lora", None)
    rank = int(getattr(lora, "lora_rank", 0) or 0)
    alpha = float(getattr(lora, "lora_alpha", 0.0) or 0.0)
    with contextlib.redirect_stdout(sys.stderr):
        from maxtext.utils import lora_utils

        path = lora_utils._get_lora_module_path(config)
    return rank, alpha, str(path)


def load_model(config: Any, *, override_model_architecture: bool = False) -> HfModel:
    """The HF mapping of a MaxText config, as ``to_huggingface.main`` builds it.

    Raises `LayoutMismatchError` for a model MaxText cannot export (listing those it can)
    and for sizes that differ from MaxText's HF config without
    ``override_model_architecture`` (naming each)."""
    th, _, _, _ = _maxtext()
    name = config.model_name
    supported = supported_models()
    if name not in supported:
        raise LayoutMismatchError(
            f"MaxText 0.2.5 cannot export model_name={name} to Hugging Face; it exports:",
            supported,
            hint="Pass the --maxtext-config of a model it supports.",
        )
    hf_config = copy.deepcopy(th.HF_MODEL_CONFIGS[name])  # MaxText's is a module global
    try:
        with contextlib.redirect_stdout(sys.stderr):
            th._validate_or_update_architecture(hf_config, config, override_model_architecture)
    except ValueError as e:
        lines = [ln.strip()[2:] for ln in str(e).splitlines() if ln.strip().startswith("- ")]
        raise LayoutMismatchError(
            f"the MaxText config's sizes differ from MaxText's Hugging Face config of {name}:",
            lines,
            hint="Pass --override-model-architecture to write the MaxText sizes (as "
            "to_huggingface --override_model_architecture does), or fix the config.",
        ) from e
    if getattr(config, "rope_type", None) == "yarn":
        th._apply_yarn_rope_config(hf_config, config)
    maps = th._get_model_mappings(name, config.scan_layers, hf_config.to_dict(), config)
    return HfModel(
        config,
        hf_config,
        maps["param_mapping"],
        maps["shape_mapping"],
        maps["hook_fn_mapping"],
        np.dtype(config.weight_dtype),
    )


def load_import(config: Any) -> HfModel:
    """The mapping MaxText's ``to_maxtext`` builds, for an import: MaxText's Hugging Face
    config of ``model_name`` given the MaxText config's sizes first (``to_huggingface``'s
    ``_validate_or_update_architecture(..., override=True)``: ``to_maxtext`` itself maps with
    the full-size config, so a resized model fails or is scaled wrongly), then its
    ``PARAM_MAPPING`` and ``HOOK_FNS`` with ``saving_to_hf=False`` (the hooks run backwards)
    and its ``HF_SHAPE``."""
    th, _, _, _ = _maxtext()
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING

    name = config.model_name
    if name not in supported_models() or name not in PARAM_MAPPING:
        raise LayoutMismatchError(
            f"MaxText 0.2.5 cannot convert model_name={name} from Hugging Face; it converts:",
            supported_models(),
            hint="Pass the --maxtext-config of a model it supports.",
        )
    hf_config = copy.deepcopy(th.HF_MODEL_CONFIGS[name])  # MaxText's is a module global
    with contextlib.redirect_stdout(sys.stderr):
        th._validate_or_update_architecture(hf_config, config, True)
    if getattr(config, "rope_type", None) == "yarn":
        th._apply_yarn_rope_config(hf_config, config)
    d = hf_config.to_dict()
    return HfModel(
        config,
        hf_config,
        PARAM_MAPPING[name](d, config, config.scan_layers),
        th.HF_SHAPE[name](d),
        HOOK_FNS[name](d, config, config.scan_layers, saving_to_hf=False),
        np.dtype(config.weight_dtype),
    )


# -- units ----------------------------------------------------------------------------------
def plan_units(model: HfModel, shapes: Mapping[str, tuple[int, ...]]) -> list[Unit]:
    """The units of a step whose MaxText params are ``shapes`` (key -> stored shape).

    As ``to_huggingface``: every param must be mapped; mapped keys the step lacks are
    skipped (a mapping serves several variants of a family), as are those mapped to None.
    """
    _, mu, _, _ = _maxtext()
    flat = {k for key in model.param_map for k in (key if isinstance(key, tuple) else (key,))}
    unmapped = sorted(set(shapes) - flat)
    if unmapped:
        raise LayoutMismatchError(
            f"MaxText's Hugging Face mapping of {model.model_name} (scan_layers="
            f"{model.scan_layers}) has no place for {len(unmapped)} params of the step:",
            unmapped,
            hint="Pass the --maxtext-config of the model that wrote the step.",
        )
    keys = mu.validate_and_filter_param_map_keys(model.param_map, set(shapes))
    if not model.config.use_multimodal:
        keys = [k for k in keys if "vision_encoder" not in "".join(_tuple(k))]
    out: list[Unit] = []
    for key in keys:
        out += _units_of(model, key, shapes[_tuple(key)[0]])
    return out


def _tuple(key: Any) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


def _units_of(model: HfModel, key: Any, shape: tuple[int, ...]) -> list[Unit]:
    """``process_maxtext_param``'s cases, one unit per slice it would make."""
    paths = model.param_map[key]
    hooks = model.hook_map.get(key)
    keys = _tuple(key)
    if paths is None:
        return []
    if not isinstance(paths, list):
        return [Unit(keys, None, None, paths, hooks)]
    if isinstance(paths[0], list):  # stacked on several axes: as utils._emit_slices cuts it
        from maxtext.checkpoint_conversion.utils.tensor_handling import (
            nesting_depth,
            stacked_axes,
        )

        depth = nesting_depth(paths)
        axes = stacked_axes(keys[0], model.config, depth)
        out: list[Unit] = []

        def emit(p: Any, idx: tuple[int, ...]) -> None:
            if len(idx) == depth:
                more = tuple((axes[k] - k, idx[k]) for k in range(1, depth))
                out.append(Unit(keys, idx[0], axes[0], p, hooks, more=more))
                return
            for i, sub in enumerate(p):
                emit(sub, (*idx, i))

        emit(paths, ())
        return out
    if model.config.scan_layers:
        axis = model.config.param_scan_axis if len(shape) > model.config.param_scan_axis else 0
    else:
        axis = 0  # an unscanned MoE param, stacked on its expert axis
    return [Unit(keys, i, axis, p, hooks) for i, p in enumerate(paths)]


def out_shapes(model: HfModel, unit: Unit) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of what ``unit`` writes, from MaxText's shape map."""
    if isinstance(unit.hf_path, tuple):
        if unit.hf_path in model.shape_map:
            return dict(zip(unit.hf_path, map(tuple, model.shape_map[unit.hf_path]), strict=True))
        return {n: tuple(model.shape_map[n]) for n in unit.hf_path}
    return {unit.hf_path: tuple(model.shape_map[unit.hf_path])}


def check_units(model: HfModel, units: Sequence[Unit], specs: Mapping[str, Any]) -> list[str]:
    """Every unit traced (shapes only, no data) through its hooks against the step's
    metadata (``specs``: key -> spec with shape and dtype); the problems, each naming the
    MaxText param and the HF tensor. Catches a config of another model, whose hooks
    would crash in a reshape or write tensors of the wrong shape."""
    import jax

    problems: list[str] = []
    for u in units:
        try:
            want = out_shapes(model, u)
        except KeyError as e:
            problems.append(f"{u.keys[0]}: MaxText's shape map has no {e}")
            continue
        args = [
            jax.ShapeDtypeStruct(u.slice_shape(specs[k].shape), model.weight_dtype) for k in u.keys
        ]
        try:
            got = jax.eval_shape(lambda *a, u=u: hooked(model, u, list(a)), *args)
        except Exception as e:  # a hook that cannot take this shape
            problems.append(
                f"{u.keys[0]} {[tuple(a.shape) for a in args]} -> {', '.join(u.names)} "
                f"{list(want.values())}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )
            continue
        got = got if isinstance(got, (tuple, list)) else [got]
        for (name, shape), g in zip(want.items(), got, strict=False):
            if int(np.prod(g.shape)) != int(np.prod(shape)):
                problems.append(
                    f"{u.keys[0]} {[tuple(a.shape) for a in args]}: {name} would be "
                    f"{tuple(g.shape)}, Hugging Face expects {shape}"
                )
    return problems


def hooked(model: HfModel, unit: Unit, arrays: list) -> Any:
    """The hooks of ``unit`` on its slice(s), as ``utils._process`` applies them."""
    _, mu, _, _ = _maxtext()
    x = arrays if len(unit.keys) > 1 else arrays[0]
    if not unit.hooks:
        return x
    if isinstance(unit.hf_path, tuple) and unit.hf_path in model.shape_map:
        target = model.shape_map[unit.hf_path]  # as utils._process passes it
    else:
        target = (
            model.shape_map[unit.hf_path]
            if isinstance(unit.hf_path, str)
            else [model.shape_map[n] for n in unit.hf_path]
        )
    return mu.apply_hook_fns(x, target, unit.hooks)


def transform(model: HfModel, unit: Unit, arrays: list[np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """The HF tensors of one unit, from its slice(s) as MaxText restores them (floats
    already in ``weight_dtype``): MaxText's hooks, then its cast to ``weight_dtype``.
    ``arrays`` is emptied once JAX holds its slices, so that they are not held twice."""
    import jax.numpy as jnp

    xs = [jnp.asarray(a) for a in arrays]
    arrays.clear()  # the caller's host copies go once JAX holds the slices
    y = hooked(model, unit, xs)
    shapes = out_shapes(model, unit)
    ys = list(y) if isinstance(unit.hf_path, tuple) else [y]
    # utils.convert_jax_weight_to_numpy without its process_allgather: each process
    # here holds whole slices, and writes only its own share.
    return [
        (name, np.asarray(v.astype(model.weight_dtype)).reshape(shape))
        for (name, shape), v in zip(shapes.items(), ys, strict=True)
    ]


def restored(array: np.ndarray, weight_dtype: np.dtype) -> np.ndarray:
    """A stored array as MaxText's ``load_orbax_checkpoint`` restores it: floats cast to
    ``weight_dtype``, the rest as stored."""
    dt = np.dtype(array.dtype)
    if (np.issubdtype(dt, np.floating) or dt.name == "bfloat16") and dt != weight_dtype:
        return array.astype(weight_dtype)
    return array


# -- config.json and tokenizer ------------------------------------------------------------
def config_json(model: HfModel) -> str:
    """``config.json``: MaxText's (``save_config_file``), made loadable under size
    overrides: one ``layer_types`` entry per layer (MaxText keeps the full model's list),
    and ``dtype`` the dtype written (MaxText keeps the HF default)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = copy.deepcopy(model.hf_config)
    if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    for c in {id(cfg): cfg, id(_text(cfg)): _text(cfg)}.values():
        n = getattr(c, "num_hidden_layers", None)
        types = getattr(c, "layer_types", None)
        if isinstance(n, int) and isinstance(types, list) and len(types) != n:
            c.layer_types = (types * (n // max(1, len(types)) + 1))[:n]
        if hasattr(c, "dtype"):
            c.dtype = model.weight_dtype.name
    return cfg.to_json_string()


def _text(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


def save_tokenizer(hf_model_path: str, directory: str) -> list[str]:
    """The tokenizer files ``save_pretrained`` writes, from ``hf_model_path``."""
    with contextlib.redirect_stdout(sys.stderr):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_model_path)
        return [os.path.basename(f) for f in tok.save_pretrained(directory)]
