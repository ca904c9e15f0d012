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


def jax_cache_dir() -> Path | None:
    """Where the test processes keep JAX's persistent compilation cache, or None (off).

    ``OMTL_TEST_JAX_CACHE``: a directory, or ``0`` for none; by default
    ``jax-compilation-cache`` under ``$ORBAX_MAXTEXT_LAYOUT_CACHE`` (else
    ``$XDG_CACHE_HOME/orbax-maxtext-layout``, else ``~/.cache/orbax-maxtext-layout``, the root
    ``.ci/interop.sh`` keeps its venvs in)."""
    chosen = os.environ.get("OMTL_TEST_JAX_CACHE", "")
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen)
    root = os.environ.get("ORBAX_MAXTEXT_LAYOUT_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "orbax-maxtext-layout"
    return Path(root) / "jax-compilation-cache"


def pytest_configure(config):
    """JAX's persistent compilation cache in the processes that run tests (each xdist worker,
    or the one pytest process; not the xdist controller, which runs none): the tests build
    the same small models, optimizers and PRNG keys again and again, and a cached executable
    loads in a fraction of its compile time (tests/test_convert_models.py and
    tests/test_writers.py run in about half the CPU time once the cache is warm).

    Set with ``jax.config``, not the environment, so the CLI and child processes the tests
    start are left as users run them (their stderr is asserted). A cache entry JAX could not
    read (e.g. one another worker was still writing) is compiled again, with a warning."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # the user's own cache settings stand
    cache = jax_cache_dir()
    if cache is None:
        return
    import jax

    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for pyproject's ``-n auto --dist loadgroup``: each test goes
    to whichever worker is free, except that every test of ``tests/gcs`` runs on one worker,
    in collection order. They share one GCS emulator (this session's, or the one ``.ci/run``
    started), and the request and byte counts of its counting proxy, which some of them
    assert, would include another worker's requests.

    The group is named here, by path, rather than by ``xdist_group`` marks: pytest-xdist 3.8
    carries a mark's group in the node id it rewrites, which pytest 9.2's node ids ignore, so
    marked tests are silently spread over the workers (pytest-xdist issue 1386). Any other
    ``--dist`` keeps xdist's own scheduler."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GcsOnOneWorker(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/gcs/"):
                return "gcs"
            return super()._split_scope(nodeid)

    return GcsOnOneWorker(config, log)


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

    from orbax_maxtext_layout.base.treepaths import flatten, norm_key

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
