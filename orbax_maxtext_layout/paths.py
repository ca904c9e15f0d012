"""The old name of `treepaths` (tree key paths, not file paths), kept so that code written
against earlier releases (``from orbax_maxtext_layout.paths import flatten``) still runs."""

from __future__ import annotations

from .base.treepaths import FlatTree, Path, children, flatten, keystr, norm_key, unflatten

__all__ = ["FlatTree", "Path", "children", "flatten", "keystr", "norm_key", "unflatten"]
