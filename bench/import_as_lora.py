"""Benchmark: ``import-hf --adapter --as-lora`` at real size (issue 60's goal: a rank-16
all-linear PEFT adapter of llama3.1-8b written as a Tunix LoRA step in at most 10 s).

    python bench/import_as_lora.py [--tiny] [--rank 16] [--layers 32] [--work DIR] [--repeats 3]

Run it with the interop venv's Python (MaxText 0.2.5). The adapter is PEFT's files
(``adapter_config.json``; ``adapter_model.safetensors``: ``lora_A (r, in)`` and ``lora_B
(out, r)`` of q, k, v, o, gate, up and down in every layer, float32, random values), of
llama3.1-8b's shapes (``--tiny``: the model cut to a few MiB, `realsize_steps.TINY`), made
once under ``--work``. Each repeat runs the command line, ``import-hf --adapter A --as-lora
--out O --json --maxtext-config base.yml ...``, in a fresh process: its wall time (MaxText's
and the package's imports included), the import's own ``seconds`` (its report: from the
call to the step published), the child's CPU time (user and system: the figure that means
something on a busy host) and its peak RSS. The step is checked once: the recorded
rank and alpha, and every factor's shape. Figures are medians (peak RSS: the largest).

Beside each repeat, the same command with ``--dry-run`` in a fresh process: MaxText's and the
package's imports, MaxText's config and abstract model, the adapter's plan and every weight's
factor map, and nothing computed from the factors or written: the floor of the import's own
figures (``floor_*``), and the part of them no change to the factors' work can touch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import realsize_steps as rs  # noqa: E402

FULL = {"emb": 4096, "heads": 32, "kv": 8, "head_dim": 128, "mlp": 14336}
TINY = {"emb": 256, "heads": 4, "kv": 2, "head_dim": 64, "mlp": 512}  # realsize_steps.TINY
ALPHA = 32


def shapes(dims: dict) -> dict[str, tuple[int, int]]:
    """Each linear module's Hugging Face ``(out, in)``."""
    e, q, kv, m = (
        dims["emb"],
        dims["heads"] * dims["head_dim"],
        dims["kv"] * dims["head_dim"],
        dims["mlp"],
    )
    return {
        "self_attn.q_proj": (q, e), "self_attn.k_proj": (kv, e), "self_attn.v_proj": (kv, e),
        "self_attn.o_proj": (e, q), "mlp.gate_proj": (m, e), "mlp.up_proj": (m, e),
        "mlp.down_proj": (e, m),
    }  # fmt: skip


def make_adapter(d: Path, dims: dict, layers: int, rank: int) -> int:
    """PEFT's files of a rank-``rank`` adapter of every linear module; its bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    if (d / "adapter_config.json").exists():
        return (d / "adapter_model.safetensors").stat().st_size
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(layers):
        for m, (out, n_in) in shapes(dims).items():
            p = f"base_model.model.model.layers.{i}.{m}"
            tensors[f"{p}.lora_A.weight"] = rng.standard_normal((rank, n_in), np.float32) * 0.01
            tensors[f"{p}.lora_B.weight"] = rng.standard_normal((out, rank), np.float32) * 0.01
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({m.split(".")[-1] for m in shapes(dims)})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "target_modules": targets}
    (d / "adapter_config.json").write_text(json.dumps(config))
    return (d / "adapter_model.safetensors").stat().st_size


def run_once(adapter: Path, out: Path, keys: list[str], dry_run: bool = False) -> dict:
    """One import in a fresh process: wall seconds, the report, peak RSS (bytes)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "orbax_maxtext_layout", "import-hf", "--adapter", str(adapter),
           "--as-lora", "--out", str(out), "--json", "--maxtext-config", str(rs.base_yml()), *keys]  # fmt: skip
    if dry_run:
        cmd.insert(cmd.index("--json"), "--dry-run")
    env = rs.child_env([HERE.parent])  # this checkout first
    start = time.monotonic()
    with tempfile.TemporaryFile() as log, tempfile.TemporaryFile() as err:
        # in this checkout: ``-m`` puts the working directory first on the path
        proc = subprocess.Popen(cmd, stdout=log, stderr=err, env=env, cwd=HERE.parent)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        log.seek(0)
        text = log.read().decode()
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(
                f"import-hf --as-lora failed ({proc.returncode}):\n{err.read().decode()[-3000:]}"
            )
    report = json.loads(text[text.index("{") :])
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,  # the child's own: the figure on a busy host
        "seconds": report["seconds"],
        "rss": usage.ru_maxrss * 1024,
        "report": report,
    }


def check(out: Path, dims: dict, layers: int, rank: int) -> None:
    """The step: rank and alpha recorded, every factor of qwix's shape (scanned, axis 1)."""
    meta = json.loads((out / "0" / "_CHECKPOINT_METADATA").read_text())
    lora = meta["custom_metadata"]["lora"]
    assert (lora["lora_rank"], lora["lora_alpha"]) == (rank, ALPHA), lora
    tree = json.loads((out / "0" / "model_params" / "_METADATA").read_text())["tree_metadata"]
    got = {k: v["value_metadata"]["write_shape"] for k, v in tree.items()}
    assert len(got) == 2 * len(shapes(dims)), sorted(got)
    for key, shape in got.items():
        assert shape[1] == layers and rank in (shape[0], shape[-1]), (key, shape)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the model cut to a few MiB: a smoke run")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=rs.LLAMA_LAYERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-as-lora")
    args = ap.parse_args(argv)
    dims = TINY if args.tiny else FULL
    adapter = args.work / f"adapter-{args.layers}-{args.rank}-{int(args.tiny)}"
    nbytes = make_adapter(adapter, dims, args.layers, args.rank)
    keys = rs.model_keys("llama", args.layers, args.tiny)
    runs, floors = [], []
    for _ in range(args.repeats):
        floors.append(run_once(adapter, args.work / "out", keys, dry_run=True))
        runs.append(run_once(adapter, args.work / "out", keys))
    check(args.work / "out", dims, args.layers, args.rank)
    row = {
        "model": "llama3.1-8b" + (" (tiny)" if args.tiny else ""),
        "layers": args.layers,
        "rank": args.rank,
        "adapter_bytes": nbytes,
        "wall_s": round(statistics.median(r["wall"] for r in runs), 2),
        "import_s": round(statistics.median(r["seconds"] for r in runs), 2),
        "cpu_s": round(statistics.median(r["cpu"] for r in runs), 2),
        "peak_rss_gib": round(max(r["rss"] for r in runs) / 2**30, 2),
        "floor_wall_s": round(statistics.median(r["wall"] for r in floors), 2),
        "floor_cpu_s": round(statistics.median(r["cpu"] for r in floors), 2),
        "repeats": args.repeats,
    }
    print(json.dumps(row))
    print(
        f"import-hf --adapter --as-lora, {row['model']}, {args.layers} layers, rank {args.rank} "
        f"({nbytes / 2**20:.0f} MiB of adapter): {row['wall_s']} s wall (a fresh process), "
        f"{row['import_s']} s in the import, {row['cpu_s']} s of CPU, peak RSS "
        f"{row['peak_rss_gib']} GiB; its --dry-run (imports, config, model, plan): "
        f"{row['floor_wall_s']} s wall, {row['floor_cpu_s']} s of CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
