"""Writes a MaxText param-only step as a pod saves it: every array in per-device chunks.

    python chunked_step.py OUT SEED CHUNKING KEY=VALUE ...

``OUT/0/items`` holds ``params/params/...`` of the model MaxText 0.2.5 builds for
``configs/base.yml`` with the given keys (`orbax_maxtext_layout.model.maxtext_config.abstract_items`),
seeded random values (weights ~0.02, norm scales ~1), saved by stock Orbax's
``CheckpointManager`` (OCDBT + zarr3, ``custom_metadata={"scan_layers": ...}``, as MaxText's
``save_checkpoint`` writes it). ``CHUNKING``:

- ``fsdp``: 8 CPU devices (``--xla_force_host_platform_device_count=8``), each param sharded
  on its largest non-layer axis that divides by 8 (replicated where none does), as an fsdp
  save cuts it: 8 per-device chunks, each spanning every layer;
- ``tp``: the same, but on the last axis that divides by 8 (heads or MLP columns);
- ``one``: one chunk per array (a single-host save).

Run as a child (`make`): the device count must be set before JAX starts its backend.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

DEVICES = 8
HERE = Path(__file__).resolve().parent


def make(out: Path, seed: int, chunking: str, keys: list[str]) -> Path:
    """``OUT/0``, written by this script in a child process with this checkout's library
    (forked from the MaxText fork server where it can be: `hf_export_support.run`)."""
    import hf_export_support as S
    import maxtext_loop_support as L

    argv = (sys.executable, str(HERE / "chunked_step.py"), str(out), str(seed), chunking, *keys)
    path = (("PYTHONPATH", os.pathsep.join([str(L.REPO), str(HERE)])),)
    proc = S.run(S.Job(f"chunked_step_{out.name}", out.parent, argv, env_extra=path))
    assert proc.returncode == 0, proc.why()
    return out / "0"


def main(out: str, seed: int, chunking: str, keys: list[str]) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import jax
    import maxtext_loop_support as L
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from orbax_maxtext_layout.model.maxtext_config import abstract_items

    argv = [str(L.base_yml()), *keys]
    scan = any(k == "scan_layers=true" for k in keys)
    abstract = abstract_items(argv)["params"]
    rng = np.random.default_rng(seed)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("fsdp",))
    scan_axis = 1  # param_scan_axis

    def axis_of(name: str, shape: tuple[int, ...]) -> int | None:
        layer = scan_axis if scan and "/layers/" in name and len(shape) > scan_axis else None
        axes = [a for a in range(len(shape)) if a != layer and shape[a] % DEVICES == 0]
        if not axes or chunking == "one":
            return None
        if chunking == "tp":
            return axes[-1]
        return max(axes, key=lambda a: shape[a])

    def fill(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        x = rng.standard_normal(leaf.shape, np.float32)
        x = x * 0.1 + 1 if name.endswith("scale") else x * 0.02
        x = x.astype(leaf.dtype)
        if chunking == "one":
            return x
        spec = [None] * x.ndim
        a = axis_of(name, x.shape)
        if a is not None:
            spec[a] = "fsdp"
        return jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, P(*spec)), lambda idx, x=x: x[idx]
        )

    params = jax.tree_util.tree_map_with_path(fill, abstract)
    manager = ocp.CheckpointManager(
        out,
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(
            0,
            args=ocp.args.Composite(items=ocp.args.PyTreeSave({"params": params})),
            custom_metadata={"scan_layers": scan},
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    gc.freeze()  # exit without walking the heap MaxText left (1.2 s)
