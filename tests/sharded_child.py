"""Writes a Tunix step as a pod saves it, every large array in 8 per-device chunks.

    python sharded_child.py ROOT STEP EMB ZARR3 [ROOT STEP EMB ZARR3 ...]

(each four arguments one step). A child process: the 8 CPU devices (``--xla_force_host_platform_device_count=8``) must be
set before JAX starts. The model is `writers.make_model` (scanned, ``param_scan_axis`` 1,
``emb`` wide); each Param is placed on a mesh of the 8 devices, sharded on its largest
non-layer axis that divides by 8 (as an fsdp run shards it), and the step is written by
`writers.write_tunix_step` (stock Orbax, as google-tunix saves): Orbax stores one chunk per
device shard, each spanning every layer.
"""

from __future__ import annotations

import os
import sys

DEVICES = 8


def main(root: str, step: int, emb: int, zarr3: bool) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import writers as W

    model = W.make_model(scanned=True, emb=emb, vocab=64, num_layers=3)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("fsdp",))
    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        x = var.value
        axes = [a for a in range(x.ndim) if a != 1 and x.shape[a] % DEVICES == 0]
        spec = [None] * x.ndim
        if axes and x.ndim > 1:
            spec[max(axes, key=lambda a: x.shape[a])] = "fsdp"
        var.value = jax.device_put(x, NamedSharding(mesh, P(*spec)))
    W.write_tunix_step(root, step, model, use_zarr3=zarr3)


if __name__ == "__main__":
    args = sys.argv[1:]
    for i in range(0, len(args), 4):
        root, step, emb, zarr3 = args[i : i + 4]
        main(root, int(step), int(emb), zarr3 == "true")
