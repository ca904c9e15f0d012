"""The real-size steps of `bench/realsize.py` (issue 30): their parameters, their paths, the
environment of every child, and the small helpers each module of the bench shares.

Standard library only: the orchestrator and the measuring wrapper import it, and a child's
ru_maxrss starts from its parent's high-water mark (see `bench/realsize.py` for the steps).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REALSIZE = HERE / "realsize.py"  # the entry: its verbs run the children (build, check-step, ...)
PKG = "orbax_maxtext_layout"
TOKENIZER = REPO / "tests" / "fixtures" / "hf_tokenizer"
BUILD_VERSION = 2  # bump when the builder writes other bytes
LLAMA_LAYERS, MOE_LAYERS = 32, 48
RANK, ALPHA = 16, 32
LORA_MODULES = {  # module -> number of leading contracting dims of its per-layer kernel
    "self_attention/query": 1,
    "self_attention/key": 1,
    "self_attention/value": 1,
    "self_attention/out": 2,
    "mlp/wi_0": 1,
    "mlp/wi_1": 1,
    "mlp/wo": 1,
}
FSDP = 8
TXN_BYTES = 1 << 30  # decoded bytes per write transaction (fsdp shards)
STEPS = {
    "llama-fsdp": {"model": "llama", "layout": "maxtext", "chunks": "fsdp"},
    "llama-onechunk": {"model": "llama", "layout": "maxtext", "chunks": "single"},
    "tunix-fsdp": {"model": "llama", "layout": "tunix", "chunks": "fsdp"},
    "lora16": {"model": "llama", "layout": "lora"},
    "moe-cut": {"model": "moe", "layout": "maxtext", "chunks": "fsdp"},
}
OPS = (
    "cp",
    "export-hf",
    "export-hf-2p",
    "merge-lora",
    "export-adapter",
    "convert-unroll",
    "verify",
    "floor-decode",
    "floor-codec",
    "baseline",
)
APPLICABLE = {
    "llama-fsdp": ("floor-decode", "export-hf", "export-hf-2p"),
    "llama-onechunk": ("floor-decode", "export-hf", "export-hf-2p"),
    "tunix-fsdp": ("floor-decode", "floor-codec", "convert-unroll", "verify"),
    "lora16": ("merge-lora", "export-adapter"),
    "moe-cut": ("floor-decode", "export-hf"),
}
# The floor of an operation (`bench/floor.py`, measured on the same step in the same run):
# what it must at least spend on this machine's 2 cores, decoding (and re-encoding) every byte.
FLOOR_OF = {
    "export-hf": "floor-decode",
    "export-hf-2p": "floor-decode",
    "convert-unroll": "floor-codec",
    "verify": "floor-decode",  # twice: both sides (`_floor_wall`)
}
MIB, GIB = 1 << 20, 1 << 30


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def child_env(pythonpath: list[Path] | None, devices: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("XLA_FLAGS", None)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
        }
    )
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def package_of(package: Path) -> Path:
    """The package directory a child with ``package`` first on its path imports: found as the
    import would find it, without importing it (MaxText's config with it, seconds of CPU)."""
    code = f"import importlib.util as u; print(u.find_spec({PKG!r}).origin)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env([package]),
        capture_output=True,
        text=True,
        check=True,
        cwd="/",  # not this checkout, which ``-c`` would put first on the path
    )
    return Path(res.stdout.strip().splitlines()[-1]).resolve().parent


def base_yml() -> Path:
    spec = importlib.util.find_spec("maxtext")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit("maxtext is not installed: run this with the interop venv's Python")
    return Path(spec.origin).parent / "configs" / "base.yml"


# ``--tiny``: each model cut to a few MiB (bench/smoke.py's smallest run), every other key as
# at real size; the dimensions still divide by 8 (the fsdp chunks).
TINY = {
    "llama": ["base_emb_dim=256", "base_mlp_dim=512", "base_num_query_heads=4"],
    "moe": ["base_emb_dim=256", "base_mlp_dim=128", "base_moe_mlp_dim=128", "num_experts=8"],
}
TINY_COMMON = ["base_num_kv_heads=2", "head_dim=64", "vocab_size=1024"]


def model_keys(model: str, layers: int, tiny: bool = False) -> list[str]:
    """MaxText's config overrides (after ``base.yml``) of a step's model."""
    assert model in ("llama", "moe"), model
    name, full = (
        ("llama3.1-8b", LLAMA_LAYERS) if model == "llama" else ("qwen3-30b-a3b", MOE_LAYERS)
    )
    keys = [f"model_name={name}", "weight_dtype=bfloat16", "scan_layers=true"]
    if layers != full or tiny:
        keys += ["override_model_config=true", f"base_num_decoder_layers={layers}"]
    if tiny:
        keys += [*TINY[model], *TINY_COMMON]
    return keys


def step_params(name: str, layers: int, moe_layers: int, seed: int, tiny: bool = False) -> dict:
    kind = STEPS[name]
    n = moe_layers if kind["model"] == "moe" else layers
    return {
        "name": name,
        **kind,
        "layers": n,
        "model_keys": model_keys(kind["model"], n, tiny),
        "seed": seed,
        "version": BUILD_VERSION,
    }


def step_path(work: Path, name: str) -> Path:
    """The step directory the operations take (``<root>/<n>``)."""
    layout = STEPS[name]["layout"]
    return work / name / ("0" if layout == "maxtext" else "1")


def flat_tree(tree, prefix=()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_tree(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def unflat_tree(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0
