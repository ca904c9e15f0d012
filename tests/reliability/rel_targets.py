"""Wrong targets for the fixture model, importable by the CLI (``--target rel_targets:NAME``).

The fixture model (DOMAIN.md section 2) is a scanned llama-shaped decoder: emb 16, 3 layers,
vocab 64. `tests/fixtures/maxtext_native` is MaxText's own checkpoint of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import rel_support as S  # noqa: E402

from orbax_maxtext_layout import Target, read_specs  # noqa: E402
from orbax_maxtext_layout.base.treepaths import unflatten  # noqa: E402


def native() -> Target:
    return Target.from_checkpoint(S.MAXTEXT_NATIVE)


def _items(target: Target) -> dict:
    return dict(target.abstract)


def _from_flat(flat: dict) -> Target:
    return Target.from_items(unflatten(flat))


def other_model() -> Target:
    """Another architecture: tests/writers.py's decoder (``mlp/wi``, a routing table, emb 8)."""
    import writers as W

    return Target.from_nnx(W.abstract_model(scanned=True))


def wider() -> Target:
    """The same model with emb 32 instead of 16: every name right, every weight mis-shaped."""
    flat = {}
    for p, x in _items(native()).items():
        shape = tuple(32 if d == 16 else d for d in x.shape) if p[0] != "nnx_aux" else x.shape
        flat[p] = jax.ShapeDtypeStruct(shape, x.dtype)
    return _from_flat(flat)


def unscanned() -> Target:
    """The fixture model unscanned (``layers_<i>``), from the DPO run's own tree."""
    flat = {}
    for p, s in read_specs(S.FIXTURES / S.DPO / "model_params").items():
        model = p[1:-1]  # drop the adapter's "base" and the "value" level
        root = ("nnx_aux", "model") if "rngs" in model else ("params", "params")
        flat[root + model] = s.abstract()
    return _from_flat(flat)


def bf16_moments() -> Target:
    """The native target with Adam's mu in bfloat16 (a differently configured optimizer)."""
    flat = {}
    for p, x in _items(native()).items():
        if p[0] == "opt_state" and "mu" in p:
            x = jax.ShapeDtypeStruct(x.shape, jax.numpy.bfloat16)
        flat[p] = x
    return _from_flat(flat)
