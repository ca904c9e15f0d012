"""Support for test_lora.py and test_families_lora.py: MaxText 0.2.5's plain and LoRA models,
built by MaxText's own code in a child process, run on a fixed token batch.

A *job* (a JSON-able dict, see `job`) names one model: the MaxText model keys of its family,
the parameters to load (``load_parameters_path``) and, for a LoRA model, qwix's settings and
the Tunix adapter step to restore. The child (``python lora_logits_support.py logits JOBS OUT``)
builds each in turn:

- plain: ``model_creation_utils.from_pretrained`` from ``load``;
- LoRA, the way ``train_sft`` builds it: ``from_pretrained`` on the base, then
  ``lora_utils.apply_lora_to_model`` and ``lora_utils.restore_lora_from_path`` (the config's
  ``lora.lora_restore_path``); the model's LoRA state is kept too, so a test can check that
  the adapters it holds are the step's and not freshly initialized ones;

and keeps the logits of each. One child runs all of a family's jobs (MaxText's PRNG setup is
process-global); independent children run side by side (`run_children`).

Top-level imports are the standard library and ``maxtext_loop_support`` only (itself standard
library at import), so the child starts with nothing loaded.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import sys
from pathlib import Path
from typing import Any

import maxtext_loop_support as L

HERE = Path(__file__).resolve().parent
CHILD_TIMEOUT_S = 900
VOCAB = 64  # every fixture family's vocab_size
RANDOM_SCALE = 0.1


def job(
    name: str,
    keys: list[str],
    load: Path | str,
    out: Path | str,
    *,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One model to build: ``keys`` are its family's MaxText keys (``scan_layers`` and any MoE
    path included); ``lora``: ``{"rank", "alpha", "restore": <step>/model_params,
    "module_path": <regex>, or None for MaxText's automatic path}``."""
    return {"name": name, "keys": list(keys), "load": str(load), "out": str(out), "lora": lora}


def model_argv(job: dict[str, Any]) -> list[str]:
    """MaxText's config for one job: ``train_sft``'s ``sft.yml`` with the job's keys."""
    _, run_keys = L.generator_keys()
    argv = [
        "logits",
        str(L.base_yml().parent / "post_train" / "sft.yml"),
        *job["keys"],
        *run_keys,
        "dataset_type=synthetic",
        "steps=1",
        f"base_output_directory={job['out']}",
        f"run_name={job['name']}",
        f"load_parameters_path={job['load']}",
    ]
    lora = job.get("lora")
    if lora:
        argv += [
            "lora.enable_lora=true",
            f"lora.lora_rank={lora['rank']}",
            f"lora.lora_alpha={float(lora['alpha'])}",
            f"lora.lora_restore_path={lora['restore']}",
        ]
        if lora.get("module_path"):
            argv.append(f"lora.lora_module_path={lora['module_path']}")
    return argv


def tokens() -> Any:
    """The fixed batch every model is run on: (2, 16) token ids in [1, 64)."""
    import numpy as np

    return np.random.RandomState(0).randint(1, VOCAB, (2, 16)).astype(np.int32)


def child_main(jobs_path: str, out_path: str) -> None:
    """For each job: build MaxText's model, run it on ``tokens()``, keep logits (and adapters)."""
    import jax

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # MaxText's train.py
    import numpy as np
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.configs import pyconfig
    from maxtext.utils import lora_utils, model_creation_utils

    jobs = json.loads(Path(jobs_path).read_text())
    out: dict[str, Any] = {}
    batch = tokens()
    positions = np.broadcast_to(np.arange(batch.shape[1], dtype=np.int32), batch.shape)
    for j in jobs:
        config = pyconfig.initialize_pydantic(model_argv(j))
        model, mesh = model_creation_utils.from_pretrained(config)
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
            if j.get("lora"):
                model = lora_utils.apply_lora_to_model(model, mesh, config)
                lora_utils.restore_lora_from_path(model, config)
                state = nnx.state(model, nnx.LoRAParam).to_pure_dict()
                for path, x in jax.tree_util.tree_leaves_with_path(state):
                    out[f"{j['name']}::{L.path_str(path)}"] = np.array(x)
                # qwix records the einsum it rewrote for each einsum weight it adapted
                # (``<weight>_lora_einsum_str`` on the module): how it applies the factors.
                for path, module in nnx.iter_graph(model):
                    for attr, value in (
                        vars(module).items() if isinstance(module, nnx.Module) else ()
                    ):
                        if attr.endswith("_lora_einsum_str") and isinstance(value, str):
                            where = "/".join(str(p) for p in (*path, attr))
                            out[f"{j['name']}:einsum:{where}"] = np.array(value)
            logits = model(
                decoder_input_tokens=batch,
                decoder_positions=positions,
                decoder_segment_ids=np.ones_like(batch),
                enable_dropout=False,
            )
        out[j["name"]] = np.array(logits, dtype=np.float32)
        print(f"logits job {j['name']}: {out[j['name']].shape}", flush=True)
    np.savez(out_path, **out)


def run_child(work: Path, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs the jobs in one child (in ``work``): ``{job name: logits}`` and, for each LoRA job,
    ``{"<name>::<module path>/<weight>_lora_{a,b}": array}`` of the model's adapters."""
    import hf_export_support as S
    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    jobs_path, out_path = work / "jobs.json", work / "logits.npz"
    jobs_path.write_text(json.dumps(jobs))
    argv = (sys.executable, str(Path(__file__)), "logits", str(jobs_path), str(out_path))
    # on CPU, offline, PYTHONHASHSEED=0, this directory on PYTHONPATH (hf_export_support.env);
    # forked from the fork server where it can be (hf_export_support.run)
    proc = S.run(S.Job("logits", work, argv, timeout=CHILD_TIMEOUT_S))
    tail = "\n".join(proc.log.splitlines()[-40:])
    assert proc.returncode == 0, f"logits child in {work}: exit {proc.returncode}\n{tail}"
    with np.load(out_path) as z:
        return {k: z[k] for k in z.files}


def run_children(children: dict[str, tuple[Path, list[dict[str, Any]]]], workers: int = 2):
    """``{key: run_child(work, jobs)}`` for ``{key: (work, jobs)}``, ``workers`` at a time."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {k: pool.submit(run_child, w, js) for k, (w, js) in children.items()}
        return {k: f.result() for k, f in futures.items()}


def write_random_adapters(src: Path, dst: Path, seed: int, scale: float = RANDOM_SCALE) -> None:
    """A copy of the Tunix LoRA step ``src`` at ``dst`` whose factors are random (``scale``
    times standard normal).

    Written as Tunix's ``CheckpointManager`` writes (``ocp.CheckpointManager`` with a
    ``PyTreeCheckpointHandler`` per item, ``custom_metadata`` {}): the new ``model_params``
    has the same paths, shapes and dtypes; ``optimizer_state`` is the source's, restored and
    saved back.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()
    params = handler.restore(epath.Path(src / "model_params"))
    opt = handler.restore(epath.Path(src / "optimizer_state"))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), dtype=x.dtype), params
    )
    manager = ocp.CheckpointManager(
        epath.Path(dst.parent),
        item_handlers={
            "model_params": ocp.PyTreeCheckpointHandler(),
            "optimizer_state": ocp.PyTreeCheckpointHandler(),
        },
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
    )
    try:
        manager.save(
            int(dst.name),
            args=ocp.args.Composite(
                model_params=ocp.args.PyTreeSave(params),
                optimizer_state=ocp.args.PyTreeSave(opt),
            ),
            custom_metadata={},
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["logits"]:
        child_main(*sys.argv[2:4])
        gc.freeze()  # exit without walking the heap MaxText left (1.2 s)
    else:
        sys.exit(f"usage: {sys.argv[0]} logits JOBS.json OUT.npz")
