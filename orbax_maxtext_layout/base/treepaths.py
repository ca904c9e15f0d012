"""Tree paths: flat-path views of nested trees (dicts, lists, tuples).

Every module here works on *flat trees*: ``{path: leaf}`` where a path is a
tuple of keys, ``str`` for a mapping key and ``int`` for a sequence index. The
same rules then apply to Orbax metadata (leaves are ``LeafSpec``) and to real
arrays, so the dry-run report and the conversion can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Path = tuple[str | int, ...]
FlatTree = dict[Path, Any]


def _is_seq(x: Any) -> bool:
    return isinstance(x, list | tuple) and not hasattr(x, "_fields")


def flatten(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> FlatTree:
    """Flattens dicts, lists, tuples, namedtuples and ``nnx.State`` into ``{path: leaf}``.

    ``None`` entries are skipped (they are gaps, not leaves), and empty containers
    vanish, as they do in Orbax checkpoints. Keys come out normal (`norm_key` leaves
    them unchanged): ``str`` for a mapping key or field name (an int mapping key
    becomes ``"0"``, as on disk), ``int`` for a position. This is the one normalisation
    of tree paths: its result needs no other.
    """
    out: FlatTree = {}
    _flatten_into(out, tree, (), is_leaf)
    return out


def _flatten_into(
    out: FlatTree, node: Any, path: Path, is_leaf: Callable[[Any], bool] | None
) -> None:
    # A module function, not a closure calling itself: such a closure is a reference
    # cycle (function -> cell -> function) that kept ``out`` and every leaf alive until
    # a full collection (issue 57).
    if node is None:
        return
    if is_leaf is not None and is_leaf(node):
        out[path] = node
    elif hasattr(node, "_fields"):  # namedtuple (optax states)
        for name in node._fields:
            _flatten_into(out, getattr(node, name), (*path, name), is_leaf)
    elif isinstance(node, Mapping):
        for k, v in node.items():
            _flatten_into(out, v, (*path, k if isinstance(k, str) else str(k)), is_leaf)
    elif _is_seq(node):
        for i, v in enumerate(node):
            _flatten_into(out, v, (*path, i), is_leaf)
    else:
        out[path] = node


def unflatten(flat: Mapping[Path, Any]) -> Any:
    """Inverse of `flatten`: ``int`` keys build lists, with ``None`` at missing indices."""
    root: dict = {}
    for path, leaf in flat.items():
        if not path:
            return leaf
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node):
        out = [None] * (max(node) + 1)
        for k, v in node.items():
            out[k] = v
        return out
    return node


def children(paths: Iterable[Path], prefix: Path) -> set[str | int]:
    """The distinct keys directly below ``prefix``."""
    n = len(prefix)
    return {p[n] for p in paths if len(p) > n and p[:n] == prefix}


def keystr(path: Path) -> str:
    """A path as ``a/b/0/c``, the form used in every message and report."""
    return "/".join(str(k) for k in path) or "<root>"


def norm_key(k: Any) -> str | int:
    """A key of a jax key path or of `flatten`'s paths as ``str`` (mapping) or ``int`` (sequence)."""
    if type(k) is str or type(k) is int:  # already normal (every key of `flatten`'s paths)
        return k
    if type(k).__module__.startswith("jax"):
        if hasattr(k, "idx"):  # SequenceKey / FlattenedIndexKey-like: a position
            return int(k.idx)
        for attr in ("key", "name"):  # DictKey, GetAttrKey: always a name
            if hasattr(k, attr):
                return str(getattr(k, attr))
    return k if isinstance(k, int) else str(k)
