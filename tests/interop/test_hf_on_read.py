"""A Hugging Face directory read as a checkpoint, and `import-hf`'s refusals and kills, with
MaxText 0.2.5's mapping (issue 43, parts 1 and 2):

- `load_params_from_path(HF_DIR, abstract, maxtext_config=...)` onto an 8-device fsdp target
  gives exactly the arrays a stock restore of `import-hf`'s output gives, with the same
  shardings (llama3.1 scanned, mixtral both forms);
- a MaxText config of another size is refused with every mismatch named (field, HF value,
  MaxText value), exit 1, nothing under --out;
- an import killed mid-write leaves no step a reader would take for complete, and the next
  run writes it;
- a tensor whose shape label is permuted (the same element count) is refused, naming it;
- a symlink in ``--out`` named like a dead run's work directory is left, never followed.

The tiny checkpoints are import_hf_support's (transformers' save_pretrained, hf venv). Each
command (and the sharded restore's child) runs as typed, forked from the suite's MaxText fork
server (hf_export_support.run_cli), but the import that is killed: a real process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import hf_export_support as S
import import_hf_support as H
import maxtext_loop_support as L
import pytest

pytestmark = pytest.mark.skipif(not H.hf_python(), reason="needs the hf venv (OMTL_HF_PYTHON)")

CHILD = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_maxtext_layout as oml
hf_dir, step, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
tree = ocp.PyTreeCheckpointer().metadata(step + "/items").item_metadata.tree
mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
def target(m):  # fsdp: each leaf cut 8 ways on its largest axis that divides by 8
    shape, spec = tuple(m.shape), [None] * len(m.shape)
    for a, n in sorted(enumerate(shape), key=lambda t: -t[1]):
        if n % 8 == 0:
            spec[a] = "fsdp"
            break
    return jax.ShapeDtypeStruct(shape, m.dtype, sharding=NamedSharding(mesh, P(*spec)))
abstract = jax.tree.map(target, tree["params"])
got = oml.load_params_from_path(hf_dir, abstract, maxtext_config=keys)
want = oml.load_params_from_path(step + "/items", abstract)
flat = jax.tree_util.tree_flatten_with_path(got)[0]
have = dict(jax.tree_util.tree_flatten_with_path(want)[0])
assert len(flat) == len(have) and len(flat) > 0
cut = 0
for p, a in flat:
    b = have[p]
    assert a.sharding == b.sharding and a.dtype == b.dtype and a.shape == b.shape, p
    assert np.array_equal(np.asarray(a), np.asarray(b)), p
    cut += len({s.index for s in a.addressable_shards}) > 1
print("equal", len(flat), "cut", cut)
"""


def _env() -> dict[str, str]:
    """A real process's environment (the killed import): hf_export_support.run_cli's."""
    return {**S.env(), **S.library_env()}


def _import(hf_dir: Path, out: Path, family: str, scan: bool, *extra: str) -> list[str]:
    """``import-hf``'s arguments (after ``python -m orbax_maxtext_layout``)."""
    return [
        "import-hf", str(hf_dir), "--out", str(out),
        "--save-dtype", "float32", "--maxtext-config", str(L.base_yml()),
        *H.FAMILY_KEYS[family], H.scan_key(scan), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return H.hf_checkpoints(tmp_path_factory, ["llama_f32", "mixtral"])


@pytest.mark.parametrize(
    ("name", "family", "scan"),
    [("llama_f32", "llama3.1", True), ("mixtral", "mixtral", True), ("mixtral", "mixtral", False)],
    ids=["llama31-scanned", "mixtral-scanned", "mixtral-unscanned"],
)
def test_a_hf_directory_restores_as_the_import_s_params_on_a_sharded_target(
    hf_dirs, tmp_path, name, family, scan
):
    out = tmp_path / "run"
    done = S.run_cli(*_import(hf_dirs[name], out, family, scan), timeout=H.CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    keys = [str(L.base_yml()), *H.FAMILY_KEYS[family], H.scan_key(scan)]
    ran = S.run_cli(argv=("-c", CHILD, str(hf_dirs[name]), str(out / "0"), *keys))
    assert ran.returncode == 0, ran.stderr[-3000:]
    equal, cut = ran.stdout.split()[1::2]
    assert int(equal) > 10 and int(cut) > 0  # every leaf, most of them cut 8 ways


def test_a_config_of_another_size_is_refused_naming_every_mismatch(hf_dirs, tmp_path):
    out = tmp_path / "run"
    argv = _import(hf_dirs["llama_f32"], out, "llama3.1", True)
    argv = [a if not a.startswith("base_mlp_dim=") else "base_mlp_dim=48" for a in argv]
    argv = [a if not a.startswith("vocab_size=") else "vocab_size=128" for a in argv]
    done = S.run_cli(*argv)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "intermediate_size (HF=32 vs MaxText=48)" in done.stderr
    assert "vocab_size (HF=64 vs MaxText=128)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def _permuted(src: Path, dst: Path) -> tuple[str, list[int], list[int]]:
    """A copy of ``src`` (one ``model.safetensors``) whose first 2-D tensor of two sizes has
    its shape label reversed, its bytes unchanged: its name, the label written, the true one."""
    import json
    import shutil
    import struct

    shutil.copytree(src, dst)
    raw = (dst / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(
        k for k, e in sorted(header.items())
        if k != "__metadata__" and len(e["shape"]) == 2 and len(set(e["shape"])) == 2
    )  # fmt: skip
    true = header[name]["shape"]
    header[name]["shape"] = true[::-1]
    text = json.dumps(header).encode()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return name, true[::-1], true


def test_a_shape_label_permuted_with_the_same_count_is_refused(hf_dirs, tmp_path):
    """MaxText's hooks reshape what they get: a permuted label would pass as scrambled
    values (it did: only the element count was compared)."""
    name, label, true = _permuted(hf_dirs["llama_f32"], tmp_path / "hf")
    out = tmp_path / "run"
    argv = _import(tmp_path / "hf", out, "llama3.1", True, "--dry-run")
    done = S.run_cli(*argv)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert f"{name}: {label}, MaxText's " in done.stderr and f"has {true}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_a_link_named_like_a_dead_run_s_work_directory_is_never_followed(hf_dirs, tmp_path):
    """A shared ``--out`` where a symlink is named like a dead import's work directory: the
    import writes its step and leaves the link (and what it points at) alone, with a warning
    naming it (it ended in a traceback: ``rmtree`` on a symlink)."""
    import socket

    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    (victim / "keep" / "data").write_text("someone else's")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a dead run's pid
    out = tmp_path / "run"
    out.mkdir()
    planted = out / f"0.orbax-checkpoint-tmp-{'a' * 12}.{socket.gethostname()}.{gone.pid}"
    planted.symlink_to(victim)
    argv = _import(hf_dirs["llama_f32"], out, "llama3.1", True)
    done = S.run_cli(*argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"{planted}: named like a dead run's work directory, but a symlink" in done.stderr
    assert planted.is_symlink() and (victim / "keep" / "data").read_text() == "someone else's"
    assert (out / "0" / "items" / "_METADATA").is_file()


def test_a_killed_import_leaves_no_step_and_the_next_run_writes_it(hf_dirs, tmp_path):
    out = tmp_path / "run"
    argv = _import(hf_dirs["mixtral"], out, "mixtral", True)
    real = [sys.executable, "-m", "orbax_maxtext_layout", *argv]  # a real process, to kill
    proc = subprocess.Popen(real, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and any(".orbax-checkpoint-tmp" in p.name for p in out.iterdir()):
            break  # the work directory is there: the step is being written
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (out / "0").exists() or proc.returncode == 0  # never a half-written step
    done = S.run_cli(*argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "0" / "items" / "_METADATA").is_file()
    assert [p.name for p in out.iterdir()] == ["0"]  # the dead run's work directory swept


def test_import_of_an_export_gives_back_the_step_s_params(tmp_path):
    """export-hf of MaxText's own step, then import-hf: every param bit for bit, but llama's
    query kernel (scaled by 1/sqrt(head_dim) out and sqrt(head_dim) in): at most 1 ulp."""
    import numpy as np
    from conftest import restore_flat

    step = H.REPO / "tests/fixtures/maxtext025/pretrain_run/checkpoints/1"
    config = ["--maxtext-config", str(L.base_yml()), *H.FAMILY_KEYS["llama3.1"]]
    exported = S.run_cli(
        "export-hf", step, "--out", tmp_path / "hf", "--override-model-architecture", *config
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    imported = S.run_cli(
        "import-hf", tmp_path / "hf", "--out", tmp_path / "run",
        "--save-dtype", "float32", *config, "scan_layers=true",
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-3000:]
    want = {k: v for k, v in restore_flat(step / "items").items() if k[0] == "params"}
    got = {k: v for k, v in restore_flat(tmp_path / "run/0/items").items() if k[0] == "params"}
    assert sorted(got) == sorted(want)
    inexact = []
    for path, value in want.items():
        a, b = np.asarray(value), np.asarray(got[path])
        assert a.dtype == b.dtype and a.shape == b.shape, path
        if not np.array_equal(a, b):
            inexact.append(path[-2])
            assert np.all(np.abs(a - b) <= np.spacing(np.abs(a).astype(a.dtype))), path
    assert inexact in ([], ["query"])
