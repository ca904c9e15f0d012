"""Restores onto the accelerator itself, where JAX's default backend is one (issue 45).

Run on a TPU host, in one pytest process (the chip has one holder): every restore path places
a converted tiny fixture step onto ``SingleDeviceSharding(jax.devices()[0])``, and each leaf
must equal, bit for bit, a stock Orbax restore of the converted items to host numpy
(`conftest.stock_restore` with ``host``, which never uses the devices the step's
``_sharding`` names: CPU devices that host does not have). Skipped where the default backend
is the CPU (CI): the other test files cover those paths there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture, stock_restore

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import flatten, keystr, norm_key, unflatten

pytestmark = pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="JAX's default backend is the CPU: these restore onto an accelerator (a TPU host)",
)

RL = RL_ACTOR_STEPS["tunix017_rl"]  # tunix017/rl_run/checkpoints/actor/2


def _device() -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _flat(tree: Any) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


@pytest.fixture(scope="module")
def abstract_items() -> dict:
    """MaxText's full restore target for the fixture model, every leaf on the default device."""
    one = _device()
    return unflatten(
        {
            p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one)
            for p, s in oml.Target.from_checkpoint(MAXTEXT_NATIVE).abstract.items()
        }
    )


@pytest.fixture
def steps(tmp_path) -> tuple[Path, Path, dict]:
    """(a copy of the Tunix step, a converted copy of it, its items restored to host numpy)."""
    tunix = copy_fixture(RL, tmp_path / "tunix")
    converted = copy_fixture(RL, tmp_path / "converted")
    oml.convert_step(converted, oml.Target.from_checkpoint(MAXTEXT_NATIVE))
    return tunix, converted, stock_restore(converted / "items", host=True)


def _assert_on_device_bit_identical(got: Any, host: Any) -> None:
    """Every leaf of ``got`` is a jax Array on the default device alone, with the dtype and
    stored bytes of ``host``'s leaf (a typed PRNG key: its key data, which the host restore
    returns)."""
    device = jax.devices()[0]
    g, w = _flat(got), _flat(host)
    assert set(g) == set(w), sorted(map(keystr, set(g) ^ set(w)))
    for p, x in g.items():
        assert isinstance(x, jax.Array), p
        assert x.devices() == {device} and x.sharding.is_equivalent_to(_device(), x.ndim), p
        key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        data = np.asarray(jax.random.key_data(x) if key else x)
        want = np.asarray(w[p])
        assert data.dtype == want.dtype and data.shape == want.shape, (p, data.dtype, want.dtype)
        assert data.tobytes() == want.tobytes(), p


def test_load_params_from_path_places_every_layout_on_the_device(steps, abstract_items):
    tunix, converted, host = steps
    params = abstract_items["params"]
    for path in (tunix / "model_params", tunix, converted / "items", converted):
        got = oml.load_params_from_path(path, params)
        _assert_on_device_bit_identical(got, host["params"])


def test_the_handler_restores_a_tunix_step_onto_the_device(steps, abstract_items):
    tunix, _, host = steps
    with ocp.Checkpointer(oml.MaxTextLayoutHandler()) as ckptr:
        got = ckptr.restore(tunix, args=oml.MaxTextLayoutRestore(item=abstract_items))
    assert sorted(got) == ["nnx_aux", "opt_state", "params", "step"]
    _assert_on_device_bit_identical(got, host)
    assert got["step"].dtype == np.int32


def test_the_handler_restores_maxtext_and_legacy_calls_onto_the_device(steps, abstract_items):
    """MaxText's own calls: restore_args built from the target (`construct_restore_args`),
    the item's leaves without shardings, on the converted step and the Tunix model_params."""
    tunix, converted, host = steps
    rargs = ocp.checkpoint_utils.construct_restore_args(abstract_items)
    with ocp.Checkpointer(oml.MaxTextLayoutHandler()) as ckptr:
        args = ocp.args.PyTreeRestore(item=abstract_items, restore_args=rargs)
        _assert_on_device_bit_identical(ckptr.restore(converted / "items", args=args), host)
        params = abstract_items["params"]
        bare = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), params)
        got = ckptr.restore(
            tunix / "model_params",
            item={"params": bare},
            transforms={},
            restore_args={"params": rargs["params"]},
        )
    _assert_on_device_bit_identical(got, {"params": host["params"]})
