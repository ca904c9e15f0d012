"""One of N processes of test_training.py's multi-process test (run as a script).

``python training_child.py <process id> <port> <checkpoint root> <pretrain step> <out.json> N``:
joins an N-process CPU ``jax.distributed`` job, builds a MaxText-style
``training.Checkpointer`` (context with ``partial_load=True``, fixed-interval save policy,
``use_async``), loads the latest step into an abstract items tree sharded over the
processes, saves the next step asynchronously as MaxText does, waits, loads the step it
loaded again (just migrated by the primary: every process must find it in the same layout),
and writes the shards it read (index and data of each addressable shard) to ``out.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from orbax.checkpoint import v1 as ocp

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.training import Checkpointer


def main(process_id: int, port: int, root: str, pretrain_step: str, out: str, n: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=process_id)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    spec = jax.sharding.PartitionSpec

    def sharded(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        even = len(s.shape) > 0 and s.shape[0] % n == 0
        sharding = jax.sharding.NamedSharding(mesh, spec("x") if even else spec())
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    abstract = jax.tree.map(sharded, oml.Target.from_checkpoint(pretrain_step).items())
    context = ocp.Context()
    context.pytree.loading.partial_load = True
    policies = ocp.training.save_decision_policies
    with Checkpointer(
        root,
        context=context,
        save_decision_policy=policies.FixedIntervalPolicy(interval=1),
        preservation_policy=ocp.training.preservation_policies.LatestN(10),
    ) as ckptr:
        ckptr.use_async = True  # as MaxText's create_orbax_checkpoint_manager sets it
        step = ckptr.latest.step
        items = ckptr.load_checkpointables(step, {"items": abstract})["items"]
        shards = _local_shards(items, abstract)
        response = ckptr.save_checkpointables_async(int(items["step"]), {"items": items})
        assert response is not None
        ckptr.wait()
        assert [c.step for c in ckptr.checkpoints] == [step, int(items["step"])]
        again = ckptr.load_checkpointables(step, {"items": abstract})["items"]  # migrated
        assert _local_shards(again, abstract) == shards
    Path(out).write_text(json.dumps(shards))


def _local_shards(items, abstract) -> dict:
    """``{leaf: [[index, values], ...]}`` of this process's shards, each leaf checked to
    have the sharding ``abstract`` asked for."""
    shards = {}
    flat_abstract = dict(jax.tree_util.tree_leaves_with_path(abstract))
    for path, x in jax.tree_util.tree_leaves_with_path(items):
        assert x.sharding.is_equivalent_to(flat_abstract[path].sharding, x.ndim), path
        typed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        data = jax.random.key_data(x) if typed else x
        shards[jax.tree_util.keystr(path)] = [
            [[[s.start, s.stop] for s in sh.index], np.asarray(sh.data).tolist()]
            for sh in data.addressable_shards
        ]
    return shards


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:6], int(sys.argv[6]))
