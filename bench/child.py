"""One measured operation, run in a fresh process; prints JSON with peak RSS."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _vm_hwm_kib() -> int:
    """This process's own peak RSS. ru_maxrss is inherited across fork+exec on
    Linux (a child starts at its parent's high-water mark), VmHWM is not."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _abstract_items(target):
    """The target's abstract items tree (also for a `--before` tree that predates `items()`)."""
    if hasattr(target, "items"):
        return target.items()
    import importlib

    old = importlib.import_module("orbax_maxtext_layout." + "_tree")  # split: not a public name
    return old.unflatten(target.abstract)


def main() -> None:
    mode, step, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    budget = int(sys.argv[4]) if len(sys.argv) > 4 else 1 << 30
    durable = len(sys.argv) > 5 and sys.argv[5] == "sync"  # the timed region ends with sync(2)
    written = 0
    files: dict = {}  # how convert placed the data files (`StepReport.data_files`)
    if mode == "cp":
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(step), str(out)], check=True)
        if durable:
            os.sync()
        wall = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        written = _du(out)
    else:
        import numpy as np
        import orbax.checkpoint as ocp
        import synth
        from etils import epath

        from orbax_maxtext_layout import convert_step, to_maxtext_items

        target = synth.target_for(step)  # metadata only, outside the timed region
        t = time.perf_counter()
        if mode in ("restore_tunix_v1", "restore_stock_v1"):
            # The same through Orbax's v1 training.Checkpointer (what MaxText 0.2.5 uses),
            # under MaxText's partial_load context.
            from orbax.checkpoint.experimental import v1 as ocp1

            abstract = _abstract_items(target)
            src = step if mode == "restore_tunix_v1" else out
            if mode == "restore_tunix_v1":
                from orbax_maxtext_layout.training import Checkpointer as cls
            else:
                cls = ocp1.training.Checkpointer
            ctx = ocp1.Context()
            ctx.pytree.loading.partial_load = True
            t = time.perf_counter()
            with cls(src.parent, context=ctx) as ckptr:
                restored = ckptr.load_checkpointables(ckptr.latest.step, {"items": abstract})
                import jax

                jax.block_until_ready(restored)
            written = 0
        elif mode in ("restore_tunix", "restore_stock"):
            # Transparent restore of the Tunix step through our manager, against a
            # stock manager restoring the same state from its converted copy.
            from orbax_maxtext_layout import CheckpointManager

            abstract = _abstract_items(target)
            args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=abstract))
            src = step if mode == "restore_tunix" else out
            cls = CheckpointManager if mode == "restore_tunix" else ocp.CheckpointManager
            t = time.perf_counter()
            with cls(epath.Path(src.parent), item_names=("items",)) as mngr:
                n = mngr.latest_step()
                restored = mngr.restore(n, args=args)["items"]
                import jax

                jax.block_until_ready(restored)
            written = 0
        elif mode == "baseline":
            pass  # imports and target only: the floor every Python mode starts from
        elif mode == "naive":
            # The upstream approach: restore the whole step to host numpy, save it again.
            h = ocp.PyTreeCheckpointHandler()

            def full(item):
                meta = h.metadata(epath.Path(step / item)).tree
                import jax

                args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
                return h.restore(
                    epath.Path(step / item), args=ocp.args.PyTreeRestore(restore_args=args)
                )

            items = to_maxtext_items(full("model_params"), full("optimizer_state"), target)
            out.mkdir(parents=True)
            w = ocp.PyTreeCheckpointHandler(use_ocdbt=True)
            w.save(epath.Path(out), args=ocp.args.PyTreeSave(items))
            w.finalize(epath.Path(out))
            written = _du(out)
        else:  # convert (the default: shared data files), copy (--copy), inplace
            kw = {"copy": True} if mode == "copy" else {"in_place": mode == "inplace"}
            report = convert_step(step, target, memory_budget=budget, **kw)
            written = report.bytes_written
            files = getattr(report, "data_files", None) or {}
        if durable:
            os.sync()
        wall = time.perf_counter() - t
        rss = _vm_hwm_kib()
    import orbax_maxtext_layout

    print(
        json.dumps(
            {
                "mode": mode,
                "wall": wall,
                "peak_rss_kib": rss,
                "written": written,
                "data_files": files,
                "package": str(Path(orbax_maxtext_layout.__file__).parent),
            }
        )
    )
    if mode == "cp":
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
