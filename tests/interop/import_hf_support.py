"""Support for test_import_hf.py (issue 43): tiny Hugging Face checkpoints, MaxText's reference
conversion of them, our ``import-hf`` of them, and leaf-by-leaf comparison with stock Orbax.

**The checkpoints** (`HF`) are written by ``transformers`` ``save_pretrained`` in the hf venv
(``OMTL_HF_PYTHON``, import_hf_writer.py), at the sizes of the fixture generator's tiny MaxText
keys (tests/fixtures/generators/gen_maxtext025.py), with seeded random values in every tensor.
``llama_bf16`` has llama_f32's seed: transformers' ``.to(bfloat16)`` rounds to nearest even, so
its tensors are llama_f32's rounded as to_maxtext rounds them with torch installed
(``ml_dtypes`` astype); `rounding_holds` checks it. ``llama_bf16_sharded`` is the same model
saved with a small ``max_shard_size`` (an index and several shards).

**The reference** (`REFS`) is MaxText 0.2.5's ``to_maxtext`` run stock through
import_hf_reference.py (its one change: MaxText's HF config resized to the MaxText config
first), in a process of its own per (model, scan form: a child of the fork server,
hf_export_support.run), with ``--save_dtype`` always given, ``--simulated_cpu_devices_count=2``
(1 crashes: the lazy tensors reach Orbax unconverted) and ``--lazy_load_tensors=true``. Two
are derived:

- ``mixtral_scanned``: to_maxtext crashes on every scanned mixtral (it stacks
  ``MoeBlock_0-gate-kernel`` on axis 0), so the reference is its unscanned output with each
  ``decoder/layers_<i>/X`` stacked on ``param_scan_axis`` (1) into ``decoder/layers/X``
  (`stack_layers`). MaxText's own scanned mixtral has the layer axis at 1 for every leaf: the
  gate ``(emb, layers, experts)``, the experts ``(experts, layers, ...)``, the norms
  ``(emb, layers)``. For llama3.1 and qwen3-moe that stacking gives to_maxtext's own scanned
  output bit for bit (test_import_hf checks it).
- ``gemma3_scanned``: MaxText 0.2.5's gemma3 mapping names ``model.language_model.*``, the
  in-memory names of transformers' ``Gemma3ForConditionalGeneration``; no file that
  ``save_pretrained`` writes has them (``Gemma3ForCausalLM`` writes ``model.*``,
  ``Gemma3ForConditionalGeneration`` ``language_model.model.*``, transformers 5.24), and
  to_maxtext's safetensors path reads names as they are in the files ("File does not contain
  tensor model.language_model.norm.weight"). Only its eager ``transformers`` path would read
  them, and that needs torch, which MaxText's Python 3.12 venv cannot have. So to_maxtext runs
  on a copy of the ``Gemma3ForCausalLM`` file with ``model.`` renamed ``model.language_model.``
  (the same tensors, byte for byte: `rename_gemma3`); ours reads the original.

Top-level imports are the standard library and the other support modules (themselves standard
library at import); NumPy and Orbax are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L

HERE = Path(__file__).resolve().parent
REPO = L.REPO
HF_PYTHON_ENV = "OMTL_HF_PYTHON"
WRITER = HERE / "import_hf_writer.py"
REFERENCE = HERE / "import_hf_reference.py"
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"
DEVICES = 2  # --simulated_cpu_devices_count (1 crashes to_maxtext's lazy save)
PARAM_SCAN_AXIS = 1
CHILD_TIMEOUT_S = 600


def _keys(keys: list[str], **overrides: object) -> list[str]:
    """A generator key list without ``scan_layers`` and ``init_weights_seed``, some replaced."""
    out = [k for k in keys if k.split("=", 1)[0] not in ("scan_layers", "init_weights_seed")]
    for name, value in overrides.items():
        (i,) = [j for j, k in enumerate(out) if k.split("=", 1)[0] == name]
        out[i] = f"{name}={value}"
    return out


_GEN = L.generator()
# family -> the MaxText keys (without scan_layers) of the tiny model, the generator's own.
# gemma3: 14 layers (as families_support.FAMILIES): two repetitions of its 6-layer block scan
# and 2 layers in decoder/layers_remainder.
FAMILY_KEYS: dict[str, list[str]] = {
    "llama3.1": _keys(_GEN.MODEL_KEYS),
    "qwen3": _keys(_GEN.QWEN3_MODEL_KEYS),
    "mixtral": _keys(_GEN.MIXTRAL_MODEL_KEYS),
    "qwen3-moe": _keys(_GEN.QWEN3MOE_MODEL_KEYS),
    "gemma3": _keys(_GEN.GEMMA3_MODEL_KEYS, base_num_decoder_layers=14),
}


@dataclasses.dataclass(frozen=True)
class Hf:
    family: str
    dtype: str  # the tensors' dtype in the files
    seed: int
    max_shard_size: str | None = None


HF: dict[str, Hf] = {
    "llama_f32": Hf("llama3.1", "float32", 1),
    "llama_bf16": Hf("llama3.1", "bfloat16", 1),  # llama_f32 rounded (rounding_holds)
    "llama_bf16_sharded": Hf("llama3.1", "bfloat16", 1, "4KB"),  # llama_bf16, 6 shards
    "qwen3_tied": Hf("qwen3", "float32", 3),  # tie_word_embeddings: no lm_head.weight
    "mixtral": Hf("mixtral", "float32", 4),
    "qwen3moe": Hf("qwen3-moe", "float32", 5),
    "gemma3": Hf("gemma3", "float32", 6),  # Gemma3ForCausalLM (text only)
}


@dataclasses.dataclass(frozen=True)
class Ref:
    hf: str
    save_dtype: str
    scan_layers: bool
    stack_of: str | None = None  # derived: this unscanned reference, stacked (stack_layers)

    @property
    def family(self) -> str:
        return HF[self.hf].family


REFS: dict[str, Ref] = {
    "llama_f32_scanned": Ref("llama_f32", "float32", True),
    "llama_f32_unscanned": Ref("llama_f32", "float32", False),
    "llama_bf16_scanned": Ref("llama_bf16", "bfloat16", True),
    "qwen3_tied_scanned": Ref("qwen3_tied", "float32", True),
    "mixtral_unscanned": Ref("mixtral", "float32", False),
    "mixtral_scanned": Ref("mixtral", "float32", True, stack_of="mixtral_unscanned"),
    "qwen3moe_scanned": Ref("qwen3moe", "float32", True),
    "qwen3moe_unscanned": Ref("qwen3moe", "float32", False),
    "gemma3_scanned": Ref("gemma3", "float32", True),  # on rename_gemma3's copy
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``import-hf`` run: ``hf`` imported with ``save_dtype`` and ``scan_layers``; its
    output must equal reference ``ref``. The id starts with the family (``-k llama31``,
    ``-k qwen3tied``, ``-k qwen3moe``, ``-k mixtral``, ``-k gemma3``)."""

    id: str
    hf: str
    save_dtype: str
    scan_layers: bool
    ref: str
    source: str | None = None  # the directory imported, if not `hf`'s (gemma3_renamed)
    budget: str | None = None  # --memory-budget, if not the default

    @property
    def family(self) -> str:
        return HF[self.hf].family


CASES: list[Case] = [
    Case("llama31-f32-scanned", "llama_f32", "float32", True, "llama_f32_scanned"),
    Case("llama31-f32-unscanned", "llama_f32", "float32", False, "llama_f32_unscanned"),
    Case("llama31-bf16-scanned", "llama_bf16", "bfloat16", True, "llama_bf16_scanned"),
    # a float32 source saved as bfloat16: what to_maxtext writes with torch installed (each HF
    # tensor rounded to bfloat16 before the hooks), i.e. its output for llama_bf16.
    Case("llama31-f32-to-bf16-scanned", "llama_f32", "bfloat16", True, "llama_bf16_scanned"),
    Case(
        "llama31-sharded-bf16-scanned", "llama_bf16_sharded", "bfloat16", True, "llama_bf16_scanned"
    ),
    Case("qwen3tied-f32-scanned", "qwen3_tied", "float32", True, "qwen3_tied_scanned"),
    Case("mixtral-f32-unscanned", "mixtral", "float32", False, "mixtral_unscanned"),
    Case("mixtral-f32-scanned", "mixtral", "float32", True, "mixtral_scanned"),
    Case("qwen3moe-f32-scanned", "qwen3moe", "float32", True, "qwen3moe_scanned"),
    Case("qwen3moe-f32-unscanned", "qwen3moe", "float32", False, "qwen3moe_unscanned"),
    Case("gemma3-f32-scanned", "gemma3", "float32", True, "gemma3_scanned"),
    # the same tensors under the names MaxText's gemma3 mapping reads (rename_gemma3)
    Case(
        "gemma3-renamed-f32-scanned",
        "gemma3",
        "float32",
        True,
        "gemma3_scanned",
        source="gemma3_renamed",
    ),
    # a budget under every slice: each runs alone, its blocks written by the pool
    # (import_hf._run_slices's slices over the budget)
    Case(
        "llama31-bf16-scanned-tiny-budget",
        "llama_bf16",
        "bfloat16",
        True,
        "llama_bf16_scanned",
        budget="1KiB",
    ),
]


def scan_key(scan_layers: bool) -> str:
    return f"scan_layers={str(scan_layers).lower()}"


def hf_python() -> str:
    return os.environ.get(HF_PYTHON_ENV, "")


# ----------------------------------------------------------------------------- HF checkpoints


def write_hf(root: Path, names: list[str]) -> dict[str, Path]:
    """``name -> directory`` of the `HF` checkpoints ``names``, written under ``root`` by one
    hf-venv child (import_hf_writer.py); its report is kept (added to ``root/written.jsonl``).
    The tests take them from `hf_checkpoints`."""
    specs = [
        {
            "out": str(root / n),
            "family": HF[n].family,
            "dtype": HF[n].dtype,
            "seed": HF[n].seed,
            "max_shard_size": HF[n].max_shard_size,
        }
        for n in names
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [hf_python(), str(WRITER), json.dumps(specs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, (
        f"import_hf_writer.py: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    )
    with open(root / "written.jsonl", "a") as report:
        report.write(proc.stdout)
    return {n: root / n for n in names}


def run_dir(tmp_path_factory) -> Path:
    """A directory of this pytest run alone, shared by all its processes: the run's base
    temporary directory (under xdist, the parent of each worker's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def hf_checkpoints(tmp_path_factory, names: list[str]) -> dict[str, Path]:
    """``name -> directory`` of the `HF` checkpoints ``names``, each written once per pytest
    run (`write_hf`, under `run_dir`; xdist workers take turns on a file lock) and then read,
    never written to, by every module that names it: inputs made by transformers from a seed
    (import_hf_writer.py), nothing of this library's."""
    import fcntl
    import shutil

    root = run_dir(tmp_path_factory) / "hf_checkpoints"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        missing = [n for n in names if not (root / f"{n}.written").is_file()]
        for n in missing:
            shutil.rmtree(root / n, ignore_errors=True)  # left by a writer that failed
        if missing:
            write_hf(root, missing)
        for n in missing:
            (root / f"{n}.written").touch()
    return {n: root / n for n in names}


def read_hf(directory: Path) -> dict[str, object]:
    """``{name: numpy array}`` of a directory's safetensors files (bfloat16 as ml_dtypes, which
    safetensors.numpy needs imported to name the dtype)."""
    import ml_dtypes  # noqa: F401

    return S.read_hf(directory)


def rename_gemma3(src: Path, dst: Path) -> Path:
    """A copy of a ``Gemma3ForCausalLM`` directory whose tensors are named as MaxText 0.2.5's
    gemma3 mapping names them (``model.`` -> ``model.language_model.``), bytes unchanged."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = read_hf(src)
    assert all(k.startswith("model.") for k in tensors), sorted(tensors)
    renamed = {"model.language_model." + k[len("model.") :]: v for k, v in tensors.items()}
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ----------------------------------------------------------------------------- jobs


def reference_job(name: str, hf_dir: Path, out: Path) -> S.Job:
    """MaxText's to_maxtext (import_hf_reference.py) for reference ``name``, into ``out``."""
    r = REFS[name]
    argv = (
        sys.executable,
        str(REFERENCE),
        str(L.base_yml()),
        *FAMILY_KEYS[r.family],
        scan_key(r.scan_layers),
        f"base_output_directory={out.resolve()}",
        "hardware=cpu",
        "skip_jax_distributed_system=True",
        f"--hf_model_path={hf_dir.resolve()}",
        f"--save_dtype={r.save_dtype}",
        f"--simulated_cpu_devices_count={DEVICES}",
        "--lazy_load_tensors=true",
    )
    return S.Job(f"to_maxtext_{name}", out.parent, argv)


def import_job(case: Case, hf_dir: Path, out: Path) -> S.Job:
    """Our ``python -m orbax_maxtext_layout import-hf`` for ``case``, into ``out``, with this
    checkout's library (hf_export_support.library_env): forked from the fork server
    (hf_export_support.run), as the command line runs it."""
    argv = (
        sys.executable,
        "-m",
        "orbax_maxtext_layout",
        "import-hf",
        str(hf_dir.resolve()),
        "--out",
        str(out.resolve()),
        "--save-dtype",
        case.save_dtype,
        *(("--memory-budget", case.budget) if case.budget else ()),
        "--maxtext-config",
        str(L.base_yml()),
        *FAMILY_KEYS[case.family],
        scan_key(case.scan_layers),
    )
    env = tuple(S.library_env().items())
    return S.Job(f"import_hf_{case.id}", out.parent, argv, env_extra=env)


def to_huggingface_job(name: str, items: Path, out: Path, family: str, scan_layers: bool) -> S.Job:
    """MaxText's to_huggingface (Base mode, ``--override_model_architecture``) on ``items``."""
    return S.export_job(
        name, items, out, TOKENIZER, scan_layers=scan_layers, keys=FAMILY_KEYS[family]
    )


def run_all(jobs: list[S.Job]) -> dict[str, S.Proc]:
    return S.run_all(jobs, workers=2)


# ----------------------------------------------------------------------------- steps


@dataclasses.dataclass
class Step:
    """What a step holds, read with stock Orbax: the params leaves (``{path: numpy array}``,
    path without the ``params/params`` prefix), the restored ``step``, the tree's paths with
    their ``value_type`` (items/_METADATA) and ``_CHECKPOINT_METADATA``'s custom_metadata."""

    params: dict[tuple[str, ...], object]
    step: object
    tree: dict[tuple[str, ...], str]
    custom: dict | None


def read_step(step_dir: Path) -> Step:
    """``step_dir`` is ``<out>/0``: restores ``items`` as numpy with stock Orbax."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    items = step_dir / "items"
    meta = json.loads((items / "_METADATA").read_text())
    tree = {}
    for entry in meta["tree_metadata"].values():
        path = tuple(str(k["key"]) for k in entry["key_metadata"])
        tree[path] = entry["value_metadata"]["value_type"]
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        structure = ckptr.metadata(items).item_metadata.tree

        def restore_arg(m):
            if isinstance(m, ocp.metadata.ArrayMetadata):
                return ocp.RestoreArgs(restore_type=np.ndarray)
            return ocp.RestoreArgs()

        args = jax.tree_util.tree_map(
            restore_arg, structure, is_leaf=lambda x: not isinstance(x, dict)
        )
        restored = ckptr.restore(items, args=ocp.args.PyTreeRestore(restore_args=args))
    finally:
        ckptr.close()
    params = {}
    for path, x in jax.tree_util.tree_flatten_with_path(restored.get("params", {}))[0]:
        p = tuple(str(getattr(k, "key", k)) for k in path)
        assert p[:1] == ("params",), p
        params[p[1:]] = x
    custom = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text()).get("custom_metadata")
    return Step(params, restored.get("step"), tree, custom)


def stack_layers(unscanned: Step, axis: int = PARAM_SCAN_AXIS) -> Step:
    """The scanned form of an unscanned step: every ``decoder/layers_<i>/X`` (``i`` = 0 .. n-1)
    stacked on ``axis`` into ``decoder/layers/X`` (axis 0 for a leaf of rank < ``axis``, as
    to_maxtext's ``_build_single_axis_stacked_tensor``); ``scan_layers`` true."""
    import numpy as np

    groups: dict[tuple[str, ...], dict[int, object]] = {}
    params = {}
    for p, x in unscanned.params.items():
        if p[:1] == ("decoder",) and p[1].startswith("layers_") and p[1][7:].isdigit():
            groups.setdefault(("decoder", "layers", *p[2:]), {})[int(p[1][7:])] = x
        else:
            params[p] = x
    for p, by_layer in groups.items():
        assert sorted(by_layer) == list(range(len(by_layer))), (p, sorted(by_layer))
        first = by_layer[0]
        at = axis if first.ndim >= axis else 0
        params[p] = np.stack([by_layer[i] for i in range(len(by_layer))], axis=at)
    tree = {("params", "params", *p): "jax.Array" for p in params}
    tree.update({p: t for p, t in unscanned.tree.items() if p[:2] != ("params", "params")})
    custom = dict(unscanned.custom or {}, scan_layers=True)
    return Step(params, unscanned.step, tree, custom)


def write_step(step: Step, out: Path) -> Path:
    """``step``'s params (and ``step``) saved with stock Orbax as ``out/0/items`` (OCDBT, zarr3),
    with ``scan_layers`` in ``out/0/_CHECKPOINT_METADATA``: a derived reference MaxText can read."""
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    tree: dict = {}
    for p, x in step.params.items():
        node = tree.setdefault("params", {})
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = x
    items = {"params": tree, "step": np.asarray(step.step)}
    manager = ocp.CheckpointManager(
        epath.Path(out).absolute(),
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(
            0,
            args=ocp.args.Composite(items=ocp.args.PyTreeSave(items)),
            custom_metadata=dict(step.custom or {}),
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    return out / "0"


# ----------------------------------------------------------------------------- comparison


def _bits(x) -> bytes:
    import numpy as np

    return np.ascontiguousarray(x).tobytes()


def step_diff(got: Step, want: Step) -> list[str]:
    """Every difference between two steps: tree paths and value types, params leaves (dtype,
    shape, bytes), ``step`` (value and dtype) and custom_metadata ``scan_layers``."""
    import numpy as np

    out = []
    for p in sorted(set(want.tree) - set(got.tree)):
        out.append(f"missing in the tree: {'/'.join(p)} ({want.tree[p]})")
    for p in sorted(set(got.tree) - set(want.tree)):
        out.append(f"unexpected in the tree: {'/'.join(p)} ({got.tree[p]})")
    for p in sorted(set(got.tree) & set(want.tree)):
        if got.tree[p] != want.tree[p]:
            out.append(f"{'/'.join(p)}: value_type {got.tree[p]} vs {want.tree[p]}")
    for p in sorted(set(want.params) - set(got.params)):
        out.append(f"missing param {'/'.join(p)}")
    for p in sorted(set(got.params) - set(want.params)):
        out.append(f"unexpected param {'/'.join(p)}")
    for p in sorted(set(got.params) & set(want.params)):
        g, w = got.params[p], want.params[p]
        name = "/".join(p)
        if g.dtype != w.dtype or g.shape != w.shape:
            out.append(f"{name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}")
        elif _bits(g) != _bits(w):
            gf, wf = g.astype(np.float64), w.astype(np.float64)
            bad = np.argwhere(gf != wf) if gf.shape == wf.shape else []
            out.append(
                f"{name}: {len(bad)} of {w.size} values differ, first at {tuple(bad[0]) if len(bad) else '?'}, "
                f"max |diff| {np.max(np.abs(gf - wf)):.3g}"
            )
    gs, ws = np.asarray(got.step), np.asarray(want.step)
    if gs.dtype != ws.dtype or gs.shape != ws.shape or _bits(gs) != _bits(ws):
        out.append(f"step: {gs.dtype}{gs.shape} {gs!r} vs {ws.dtype}{ws.shape} {ws!r}")
    g_scan = (got.custom or {}).get("scan_layers")
    w_scan = (want.custom or {}).get("scan_layers")
    if g_scan != w_scan:
        out.append(f"custom_metadata scan_layers: {g_scan!r} vs {w_scan!r}")
    return out


def ulps_f32(a, b):
    """``|a - b|`` in units in the last place of float32 (elementwise, same shapes)."""
    import numpy as np

    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    # map the sign-magnitude float order onto a monotonic integer line
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)
