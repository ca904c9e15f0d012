"""The abstract target a conversion is checked and split against.

Only the model can say which leaf of Tunix's mixed ``model_params`` tree is a
weight and which is RNG or other state; a `Target` records that answer once, in
the stored form of every leaf (see `LeafSpec`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from etils import epath

from ..base.step_entries import MAXTEXT_ITEM, Dest
from ..base.treepaths import FlatTree, Path, flatten, keystr, unflatten
from ..errors import LayoutMismatchError
from ..orbax_io.spec import LeafSpec, read_specs, spec_of

PARAMS_ROOT: Path = ("params", "params")
AUX_ROOT: Path = ("nnx_aux", "model")
OPT_ROOT: Path = ("opt_state",)
STEP_PATH: Path = ("step",)

# Values that NNX modules `sow` as `nnx.Intermediate` during a forward pass. A
# checkpoint saved after one can hold them while an `nnx.eval_shape` target
# never does; they are dropped (and reported), never routed to nnx_aux.
KNOWN_INTERMEDIATES: tuple[str, ...] = ("max_logits", "moe_lb_loss", "intermediates")


@dataclasses.dataclass(frozen=True)
class Target:
    """Abstract MaxText-layout target.

    Attributes:
      params: model path -> spec, for leaves under ``params/params``.
      nnx_aux: model path -> spec, for leaves under ``nnx_aux/model``.
      opt_state: path -> spec under ``opt_state``, or ``None`` when the target
        carries no optimizer (then the canonical optimizer rules apply).
      intermediates: model paths the target itself marks as `nnx.Intermediate`/`Cache`.
      param_scan_axes: model path -> ``param_scan_axis`` metadata of Params that have it.
      abstract: full items path -> the abstract leaf given (keeps shardings for restores).
      twin: the same model in the other scan form, where MaxText built both from its config
        (`from_maxtext_config` with ``both_forms``); `rescan.forms` uses it.
      origin: what the target was built from, for errors ("the target <origin>"): the
        checkpoint's path (`from_checkpoint`), the MaxText config's ``model_name``
        (`from_maxtext_config`); empty where unknown.
    """

    params: Mapping[Path, LeafSpec]
    nnx_aux: Mapping[Path, LeafSpec]
    opt_state: Mapping[Path, LeafSpec] | None = None
    intermediates: frozenset[Path] = frozenset()
    param_scan_axes: Mapping[Path, int] = dataclasses.field(default_factory=dict)
    abstract: FlatTree = dataclasses.field(default_factory=dict, repr=False)
    twin: Target | None = dataclasses.field(default=None, repr=False, compare=False)
    origin: str = dataclasses.field(default="", repr=False, compare=False)

    # -- constructors -----------------------------------------------------------------
    @classmethod
    def from_nnx(cls, abstract: Any, *, optimizer: Any = None, opt_state: Any = None) -> Target:
        """Classifies an abstract `nnx.Module` or `nnx.State` by Variable type.

        `nnx.Param` (and subclasses such as `LoRAParam`) -> params; `nnx.Intermediate`
        and `nnx.Cache` -> dropped; every other Variable (RNG count/key, batch stats,
        custom Variables) -> nnx_aux. ``optimizer`` (an abstract `nnx.Optimizer`, e.g.
        from `nnx.eval_shape`) adds the optimizer state in the form MaxText checkpoints
        it (`maxtext_opt_state`); ``opt_state`` gives that MaxText-form tree directly.
        """
        from flax import nnx  # flax is heavy; import only when NNX targets are used

        if optimizer is not None:
            opt_state = maxtext_opt_state(nnx.state(optimizer, nnx.optimizer.OptState))
        state = nnx.state(abstract) if isinstance(abstract, nnx.Module) else abstract
        params, aux, inter, axes, leaves = {}, {}, set(), {}, {}
        for raw_path, var in nnx.to_flat_state(state):
            path = tuple(str(k) for k in raw_path)  # State keys are mapping keys (nnx.List: "0")
            value = var.get_value() if hasattr(var, "get_value") else var
            if isinstance(var, nnx.Intermediate | nnx.Cache):
                inter.add(path)
            elif isinstance(var, nnx.Param):
                params[path] = spec_of(value)
                leaves[PARAMS_ROOT + path] = value
                meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
                if "param_scan_axis" in meta:
                    axes[path] = int(meta["param_scan_axis"])
            else:
                aux[path] = spec_of(value)
                leaves[AUX_ROOT + path] = value
        opt = None
        if opt_state is not None:
            opt_flat = flatten(opt_state, is_leaf=_is_array_like)
            opt = {p: spec_of(v) for p, v in opt_flat.items()}
            leaves.update({OPT_ROOT + p: v for p, v in opt_flat.items()})
        return cls(params, aux, opt, frozenset(inter), axes, leaves)

    @classmethod
    def from_items(cls, abstract_items: Mapping[str, Any]) -> Target:
        """Classifies a MaxText-layout abstract tree by path.

        ``abstract_items`` is ``{"params": {"params": ...}, "nnx_aux": {...},
        "opt_state": ..., "step": ...}`` with ShapeDtypeStruct or array leaves, the
        restore target MaxText builds.
        """
        return cls.from_flat_items(flatten(abstract_items, is_leaf=_is_array_like))

    @classmethod
    def from_flat_items(cls, abstract: Mapping[Path, Any]) -> Target:
        """`from_items` of a tree already flattened: ``{items path: abstract leaf}``."""
        return cls._from_flat({p: spec_of(v) for p, v in abstract.items()}, abstract)

    @classmethod
    def from_checkpoint(cls, path: epath.PathLike) -> Target:
        """The target of an existing MaxText-layout checkpoint (``<step>`` or ``<step>/items``).

        Reads Orbax metadata only, never array bytes.
        """
        path = epath.Path(path)
        items = path if (path / "_METADATA").exists() else path / MAXTEXT_ITEM
        if not (items / "_METADATA").exists():
            raise LayoutMismatchError(
                f"{path}: not a MaxText-layout checkpoint (no items/_METADATA).",
                hint="Pass a MaxText step directory (holding items/) or its items/ directory.",
            )
        target = cls.from_specs(read_specs(items))
        return dataclasses.replace(target, origin=f"--target-from {path}")

    @classmethod
    def from_specs(cls, specs: Mapping[Path, LeafSpec]) -> Target:
        """The target of a MaxText items tree known by its stored specs (`read_specs` of an
        ``items`` directory), e.g. when the caller has read them already."""
        return cls._from_flat(specs, {p: s.abstract() for p, s in specs.items()})

    @classmethod
    def from_maxtext_config(cls, argv: Sequence[str]) -> Target:
        """The target MaxText 0.2.5 builds from its own config: the config file, then its
        ``KEY=VALUE`` overrides, as MaxText's commands take them (e.g. ``[".../base.yml",
        "model_name=llama3.1-8b", "scan_layers=true"]``).

        Built by MaxText's own code (`maxtext_config.abstract_model`): abstract, no weights,
        on this process's devices; each scanned Param keeps the ``param_scan_axis`` MaxText
        gives it (`param_scan_axes`). `rescan.maxtext_forms` builds both scan forms. Raises ImportError where MaxText cannot be imported (it
        is not a dependency; maxtext 0.2.5 needs Python 3.12) and `UsageError` where MaxText
        rejects the config.
        """
        from .maxtext_config import abstract_model  # imports MaxText: only when asked

        items, axes = abstract_model(argv)
        target = cls.from_items(items)
        names = [a.split("=", 1)[1] for a in argv if a.startswith("model_name=")]
        origin = f"MaxText's {names[-1]}" if names else f"MaxText's config {argv[0]}"
        return dataclasses.replace(target, param_scan_axes=axes, origin=origin)

    @classmethod
    def _from_flat(cls, specs: Mapping[Path, LeafSpec], abstract: FlatTree) -> Target:
        params, aux, opt, unknown = {}, {}, {}, []
        for p, s in specs.items():
            if p[:2] == PARAMS_ROOT:
                params[p[2:]] = s
            elif p[:2] == AUX_ROOT:
                aux[p[2:]] = s
            elif p[:1] == OPT_ROOT:
                opt[p[1:]] = s
            elif p != STEP_PATH:
                unknown.append(keystr(p))
        if unknown:
            raise LayoutMismatchError(
                "The target is not in MaxText's items layout; these paths fit no section:",
                unknown,
                hint="Expected only params/params/..., nnx_aux/model/..., opt_state/... and step.",
            )
        has_opt = any(p[:1] == OPT_ROOT for p in specs)
        return cls(params, aux, opt if has_opt else None, abstract=dict(abstract))

    # -- queries ----------------------------------------------------------------------
    def items(self) -> Any:
        """The abstract MaxText items tree (``{"params": {"params": ...}, "nnx_aux": ...,
        "opt_state": ..., "step": ...}``) this target was built from, with its shardings:
        what to pass as ``item`` to a restore."""
        return unflatten(self.abstract)

    def without_optimizer(self) -> Target:
        twin = self.twin and dataclasses.replace(self.twin, opt_state=None)
        return dataclasses.replace(self, opt_state=None, twin=twin)

    def model_paths(self) -> set[Path]:
        return set(self.params) | set(self.nnx_aux)

    def classify(self, path: Path, ignore: Iterable[str] = ()) -> Dest | None:
        """Destination of a model leaf (no ``value``/adapter level), or None if unknown."""
        if path in self.params:
            return Dest.PARAMS
        if path in self.nnx_aux:
            return Dest.NNX_AUX
        if path in self.intermediates or is_intermediate(path, ignore):
            return Dest.DROPPED
        return None


def maxtext_opt_state(nnx_opt_state: Any) -> Any:
    """The optimizer state as MaxText 0.2.5 checkpoints it (``_opt_state_to_linen``).

    Takes ``nnx.state(optimizer, OptState)`` (or its ``opt_state`` part). Not
    recursive, like MaxText: an outermost int-keyed chain becomes a list with ``None``
    gaps and its members' own ``mu``/``nu`` are wrapped as ``{"params": ...}``;
    anything else stays a dict with only its top-level ``mu``/``nu`` wrapped. Nested
    chains and an ``inject_hyperparams`` shell are left as they are.
    """
    tree = nnx_opt_state.to_pure_dict() if hasattr(nnx_opt_state, "to_pure_dict") else nnx_opt_state
    if isinstance(tree, Mapping) and "opt_state" in tree:
        tree = tree["opt_state"]

    def wrap(node: Any) -> Any:
        if not isinstance(node, Mapping):
            return node
        return {k: {"params": v} if k in ("mu", "nu") else v for k, v in node.items()}

    if not isinstance(tree, Mapping):
        return tree
    if tree and all(isinstance(k, int) or str(k).isdigit() for k in tree):
        chain: list[Any] = [None] * (max(int(k) for k in tree) + 1)
        for k, v in tree.items():
            chain[int(k)] = wrap(v)
        return chain
    return wrap(tree)


def is_intermediate(path: Path, ignore: Iterable[str] = ()) -> bool:
    """True for a known sown-intermediate name, or a path matching a user glob."""
    if any(str(k) in KNOWN_INTERMEDIATES for k in path):
        return True
    s = keystr(path)
    return any(fnmatch.fnmatchcase(s, pat) for pat in ignore)


def _is_array_like(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct | jax.Array) or hasattr(x, "dtype")
