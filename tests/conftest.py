"""Shared test helpers. Tests read only the frozen fixtures under tests/fixtures."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MAXTEXT_NATIVE = FIXTURES / "maxtext_native" / "run" / "checkpoints" / "2"

# Every scanned RL actor step among the real fixtures (DOMAIN.md section 2).
RL_ACTOR_STEPS = {
    "tunix017_rl": "tunix017/rl_run/checkpoints/actor/2",
    "tunix017_pathways": "tunix017_pathways_style/actor/1",
    "v1_rl": "tunix_snapshot_v1/rl_run/checkpoints/actor/2",
    "v1_rl_default_opts": "tunix_snapshot_v1/rl_run_default_opts/checkpoints/actor/2",
}
SFT_STEPS = {
    "tunix017_sft": "tunix017/sft_run/checkpoints/1",
    "v1_sft": "tunix_snapshot_v1/sft_run/checkpoints/1",
}


def copy_fixture(rel: str, dest: Path) -> Path:
    """Copies a frozen fixture step into ``dest`` (writable) and returns the copy."""
    out = dest / rel  # keep the numeric step name and any role level
    shutil.copytree(FIXTURES / rel, out)
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    return out


def tree_digest(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``."""
    out = {}
    root = Path(root)
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file() and not any(rel == e or rel.startswith(e + "/") for e in exclude):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def restore_flat(item_dir) -> dict:
    """Stock Orbax restore of a whole item, flattened to ``{path: array}``."""
    import orbax.checkpoint as ocp
    from etils import epath

    from orbax_maxtext_layout.treepaths import flatten, norm_key

    tree = ocp.PyTreeCheckpointHandler().restore(epath.Path(item_dir))
    flat = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in flat.items()}


def raw(x):
    """An array's stored values as numpy; typed PRNG keys as their uint32 data."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


@pytest.fixture
def maxtext_target():
    from orbax_maxtext_layout import Target

    return Target.from_checkpoint(MAXTEXT_NATIVE)
