"""Tree rules: small named functions over sets of paths.

Each rule maps every path it is given to a new path, or to `Dropped` with a
reason. Rules never look at values, so one rule serves Orbax metadata (dry run,
planning) and real arrays alike, and a plan can list the rules it applied.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping

from ..base.treepaths import Path, keystr
from ..errors import LayoutMismatchError

INJECT_SHELL = ("count", "hyperparams", "hyperparams_states", "inner_state")
MULTISTEPS_SHELL = ("mini_step", "gradient_step", "inner_opt_state", "acc_grads")
# Keys under which an optax state mirrors the model's parameter tree. Chain
# rules never descend into these: a model may itself have digit-named modules.
MOMENT_KEYS = frozenset({"mu", "nu", "trace", "acc_grads", "ema", "nu_hat", "v_row", "v_col"})
WRAPPED_MOMENTS = frozenset({"mu", "nu"})
ADAPTER_KEY = "base"


@dataclasses.dataclass(frozen=True)
class Dropped:
    reason: str


Mapping_ = dict[Path, "Path | Dropped"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A named path rule. ``inverse`` describes how to undo it, for the report."""

    name: str
    fn: Callable[[Collection[Path]], Mapping_]
    doc: str

    def __call__(self, paths: Collection[Path]) -> Mapping_:
        return self.fn(paths)


def _children_index(paths: Collection[Path]) -> dict[Path, set]:
    index: dict[Path, set] = defaultdict(set)
    for p in paths:
        for i in range(len(p)):
            index[p[:i]].add(p[i])
    return index


def _in_moments(path: Path, upto: int) -> bool:
    return any(k in MOMENT_KEYS for k in path[:upto])


# -- value level ----------------------------------------------------------------------
def unwrapped_positions(paths: Collection[Path]) -> dict[Path, tuple[int, ...]]:
    """Positions of each path's keys that `unwrap_value` keeps.

    A serialised nnx.Variable is {"value": x}: a "value" key is a level only where it
    is the sole child of its parent, so a module named "value" (an attention value
    projection beside query/key/out) is kept. `scan` needs the positions, not only the
    unwrapped path, to rename a key of the original path.
    """
    index = _children_index(paths)
    return {
        p: tuple(i for i, k in enumerate(p) if not (k == "value" and index[p[:i]] == {"value"}))
        for p in paths
    }


def _unwrap_value(paths: Collection[Path]) -> Mapping_:
    return {p: tuple(p[i] for i in kept) for p, kept in unwrapped_positions(paths).items()}


unwrap_value = Rule("unwrap_value", _unwrap_value, "strip the serialised-Variable 'value' level")


# -- adapter level --------------------------------------------------------------------
def _drop_adapter(paths: Collection[Path]) -> Mapping_:
    return {p: p[1:] if p[:1] == (ADAPTER_KEY,) else p for p in paths}


drop_adapter = Rule("drop_adapter", _drop_adapter, "drop the top-level adapter 'base' level")


def _drop_adapter_in_moments(paths: Collection[Path]) -> Mapping_:
    out: Mapping_ = {}
    for p in paths:
        i = next((i for i, k in enumerate(p) if k in MOMENT_KEYS), None)
        out[p] = (
            p[: i + 1] + p[i + 2 :] if i is not None and p[i + 1 : i + 2] == (ADAPTER_KEY,) else p
        )
    return out


drop_adapter_in_moments = Rule(
    "drop_adapter_in_moments", _drop_adapter_in_moments, "drop 'base' inside mu/nu-like trees"
)


# -- optimizer shells -----------------------------------------------------------------
def _peeler(
    shell: tuple[str, ...], inner: str, label: str
) -> Callable[[Collection[Path]], Mapping_]:
    def peel(paths: Collection[Path]) -> Mapping_:
        index = _children_index(paths)
        shells = {
            prefix
            for prefix, kids in index.items()
            if inner in kids and kids <= set(shell) and not _in_moments(prefix, len(prefix))
        }
        out: Mapping_ = {}
        for p in paths:
            prefix = next((s for s in sorted(shells, key=len) if p[: len(s)] == s), None)
            if prefix is None:
                out[p] = p
            elif p[len(prefix)] == inner:
                out[p] = prefix + p[len(prefix) + 1 :]
            else:
                out[p] = Dropped(f"{label} shell field '{p[len(prefix)]}' (not optimizer state)")
        return out

    return peel


peel_inject = Rule(
    "peel_inject_hyperparams",
    _peeler(INJECT_SHELL, "inner_state", "inject_hyperparams"),
    "replace an inject_hyperparams shell by its inner_state",
)
peel_multisteps = Rule(
    "peel_multisteps",
    _peeler(MULTISTEPS_SHELL, "inner_opt_state", "MultiSteps"),
    "replace an optax.MultiSteps shell by its inner_opt_state",
)


# -- chains ---------------------------------------------------------------------------
def _is_digit(k: object) -> bool:
    return isinstance(k, str) and k.isdigit()


def _chain_to_list(paths: Collection[Path]) -> Mapping_:
    # NNX stores optax chains as dicts keyed '0', '1', ... (EmptyState members are
    # missing); MaxText's Linen form is a list with None at the gaps.
    index = _children_index(paths)
    out: Mapping_ = {}
    for p in paths:
        new = list(p)
        for i, k in enumerate(p):
            if k in MOMENT_KEYS:
                break
            if _is_digit(k) and all(_is_digit(c) or isinstance(c, int) for c in index[p[:i]]):
                new[i] = int(k)
        out[p] = tuple(new)
    return out


chain_to_list = Rule("chain_to_list", _chain_to_list, "chain dicts ('0','1',...) become lists")


def _top_chain_to_list(paths: Collection[Path]) -> Mapping_:
    # MaxText 0.2.5's `_opt_state_to_linen` is not recursive: only the outermost
    # chain becomes a list; nested chains stay (int-keyed) dicts.
    roots = _children_index(paths)[()]
    if not roots or not all(_is_digit(k) for k in roots):
        return {p: p for p in paths}
    return {p: (int(p[0]), *p[1:]) for p in paths}


top_chain_to_list = Rule(
    "top_chain_to_list", _top_chain_to_list, "the outermost chain dict becomes a list (MaxText)"
)


def select_chain_member(index: int) -> Rule:
    """Keep only member ``index`` of a top-level chain, dropping the rest (e.g. the clip slot)."""

    def fn(paths: Collection[Path]) -> Mapping_:
        out: Mapping_ = {}
        for p in paths:
            if p[:1] in ((str(index),), (index,)):
                out[p] = p[1:]
            else:
                out[p] = Dropped(f"chain member {p[0]!s} is not in the target optimizer")
        return out

    return Rule(f"select_chain_member[{index}]", fn, f"keep chain member {index} only")


# -- moments --------------------------------------------------------------------------
def _wrap_moments(paths: Collection[Path]) -> Mapping_:
    out: Mapping_ = {}
    for p in paths:
        i = next((i for i, k in enumerate(p) if k in MOMENT_KEYS), None)
        out[p] = (
            p[: i + 1] + ("params",) + p[i + 1 :]
            if i is not None and p[i] in WRAPPED_MOMENTS
            else p
        )
    return out


wrap_moments = Rule("wrap_moments", _wrap_moments, "wrap mu/nu under 'params' (Linen form)")


def apply(rule: Rule, current: Mapping[Path, Path]) -> tuple[dict[Path, Path], dict[Path, str]]:
    """Applies ``rule`` to ``{current_path: source_path}``.

    Returns the renamed mapping and ``{source_path: reason}`` for what it dropped.
    Two source leaves landing on one path is a bug in a rule's preconditions, so
    it raises rather than silently losing one.
    """
    mapping = rule(list(current))
    kept: dict[Path, Path] = {}
    dropped: dict[Path, str] = {}
    clashes: list[str] = []
    for cur, src in current.items():
        new = mapping[cur]
        if isinstance(new, Dropped):
            dropped[src] = new.reason
        elif new in kept:
            clashes.append(f"{keystr(kept[new])} and {keystr(src)} both become {keystr(new)}")
        else:
            kept[new] = src
    if clashes:
        raise LayoutMismatchError(
            f"Rule {rule.name} would merge leaves; the tree is not in the expected layout:",
            clashes,
            hint="Two checkpoint leaves would land on one path; check the checkpoint's tree.",
        )
    return kept, dropped
