"""Interop: every model family MaxText 0.2.5 builds, through ``convert --unroll``/``--stack``
and ``export-hf``, judged by MaxText's own code.

The families (`families_support.FAMILIES`): plain scans (llama3.1, gemma2, mixtral and
qwen3-moe, whose MoE weights stack experts and layers), block scans (gemma3 with a remainder,
gpt-oss, llama4) and DeepSeek's ``dense_layers``/``moe_layers``. What proves what:

- *the layer map is MaxText's*: built from a family's config in either scan form,
  `rescan.maxtext_forms` reads the scans off MaxText's scanned model and checks every weight,
  unrolled, against MaxText's own unscanned model (path and shape);
- *unroll puts every layer where MaxText's exporter expects it*: a synthetic scanned Tunix
  step of the family's model (every leaf random), exported raw by ``export-hf`` (MaxText's
  scanned param mapping: which scan step is which Hugging Face layer), equals the export of
  its ``convert --unroll`` output (MaxText's unscanned mapping), tensor by tensor and byte by
  byte, with or without ``scan_layers`` given; ``verify`` passes; the step records
  ``scan_layers=false``;
- *stack undoes it*: the unrolled values, written as an unscanned Tunix step and converted
  ``--stack``, give back every weight of the original bit for bit.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import families_support as F
import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout import Target
from orbax_maxtext_layout.base.treepaths import flatten, unflatten
from orbax_maxtext_layout.model.layer_axes import layer_map
from orbax_maxtext_layout.model.scan_trees import unstack_layer
from orbax_maxtext_layout.plan import rescan

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from conftest import raw, restore_flat  # noqa: E402  (tests/conftest.py helpers)

P, A = ("params", "params"), ("nnx_aux", "model")
# What each family's layer map says (`LayerMap.describe`), read off MaxText's two forms.
LAYERS = {
    "llama3.1": ["decoder/layers: 3 scan steps, one layer a step -> decoder/layers_<i>"],
    "gemma2": ["decoder/layers: 4 scan steps, one layer a step -> decoder/layers_<i>"],
    "gemma3": [
        "decoder/layers: 2 scan steps, blocks of 6 sub-layers -> decoder/layers_<i>",
        "decoder/layers_remainder/layers_0: stored per layer -> decoder/layers_12",
        "decoder/layers_remainder/layers_1: stored per layer -> decoder/layers_13",
    ],
    "mixtral": ["decoder/layers: 2 scan steps, one layer a step -> decoder/layers_<i>"],
    "qwen3-moe": ["decoder/layers: 2 scan steps, one layer a step -> decoder/layers_<i>"],
    "gpt-oss": ["decoder/layers: 2 scan steps, blocks of 2 sub-layers -> decoder/layers_<i>"],
    "llama4": ["decoder/layers: 1 scan steps, blocks of 4 sub-layers -> decoder/layers_<i>"],
    "deepseek3": [
        "decoder/dense_layers: 1 scan steps, one layer a step -> decoder/dense_layers_<i>",
        "decoder/moe_layers: 2 scan steps, one layer a step -> decoder/moe_layers_<i>",
    ],
}
# Families MaxText 0.2.5's to_huggingface exports (hf_mapping.supported_models()).
EXPORTED = ["llama3.1", "gemma2", "gemma3", "mixtral", "qwen3-moe", "gpt-oss"]


@functools.cache
def maxtext_forms(family: str, scanned: bool) -> Target:
    """`rescan.maxtext_forms` of the family's config with ``scan_layers`` given (MaxText
    builds the model in both forms): once per family and form in this module's process,
    shared by its tests (a frozen `Target`, read only)."""
    return rescan.maxtext_forms(F.config(family, scan_layers=scanned))


@pytest.mark.parametrize("family", sorted(F.FAMILIES))
def test_layer_map_is_read_off_maxtext_s_two_forms(family):
    for scanned in (True, False):
        target = maxtext_forms(family, scanned)
        assert rescan.is_scanned(target) is scanned
        assert target.twin is not None and rescan.is_scanned(target.twin) is not scanned
        stacked = target if scanned else target.twin
        assert layer_map(stacked).describe() == LAYERS[family]
        # MaxText's metadata says where each scanned weight keeps its layers.
        assert set(stacked.param_scan_axes.values()) == {1}, family


def _read_hf(directory: Path) -> dict:
    from safetensors.numpy import load_file

    out: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same_tensors(got: dict, want: dict) -> list[str]:
    out = [f"missing {n}" for n in sorted(set(want) - set(got))]
    out += [f"unexpected {n}" for n in sorted(set(got) - set(want))]
    return out + [
        n
        for n in sorted(set(got) & set(want))
        if got[n].shape != want[n].shape or got[n].tobytes() != want[n].tobytes()
    ]


def _unrolled_run(family: str, tmp: Path) -> tuple[dict, Path, Path]:
    """(the scanned state, a pristine copy of its Tunix step, the step converted --unroll)."""
    # The scanned config, as a user passes the model's own config: the output is unscanned.
    target = maxtext_forms(family, True)
    state = F.model_state(family, scan_layers=True, abstract=target.abstract)
    step = F.write_tunix_step(tmp / "run", 1, state)
    pristine = tmp / "pristine" / "1"
    shutil.copytree(step, pristine)
    report = oml.convert_step(step, target, rescan="unroll", optimizer="drop")
    assert "unroll" in report.rules
    return state, pristine, step


@pytest.mark.parametrize("family", [*EXPORTED, "llama4", "deepseek3"])
def test_unroll_is_maxtext_s_unscanned_layout_and_stack_undoes_it(family, tmp_path):
    state, pristine, step = _unrolled_run(family, tmp_path)
    assert oml.verify_step(step).ok
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"]["scan_layers"] is False
    unscanned = maxtext_forms(family, False)
    items = restore_flat(step / "items")
    # Exactly MaxText's unscanned weights, and only RNG state its unscanned model holds.
    assert {p[2:] for p in items if p[:2] == P} == set(unscanned.params)
    assert {p[2:] for p in items if p[:2] == A} <= set(unscanned.nnx_aux)

    if family in EXPORTED:
        unrolled = tmp_path / "hf_unrolled"
        oml.export_hf(
            step / "items",
            unrolled,
            maxtext_config=F.config(family),
            override_model_architecture=True,
        )
        for keys in ([], ["scan_layers=true"]):  # read from the raw step, or given
            out = tmp_path / f"hf_raw{len(keys)}"
            oml.export_hf(
                pristine,
                out,
                maxtext_config=F.config(family) + keys,
                override_model_architecture=True,
            )
            raw_hf = _read_hf(out)
            assert raw_hf and _same_tensors(_read_hf(unrolled), raw_hf) == [], family

    # Back: the unrolled values as an unscanned Tunix step, converted --stack.
    flat = {p[2:]: v for p, v in items.items() if p[:2] in (P, A)}
    back = F.write_tunix_step(tmp_path / "unscanned_run", 1, flat)
    oml.convert_step(back, unscanned, rescan="stack", optimizer="drop")
    assert oml.verify_step(back).ok
    got = restore_flat(back / "items")
    weights = [p for p in state if P + p in got]
    assert len(weights) == len(maxtext_forms(family, True).params)
    differ = [p for p in weights if raw(got[P + p]).tobytes() != raw(state[p]).tobytes()]
    assert differ == [], family
    # RNG state the unscanned step held (layer 0's shared stream) comes back to layer 0.
    aux = unflatten({p: v for p, v in got.items() if p[:1] == ("nnx_aux",)})
    layer0 = flatten(unstack_layer(aux, unscanned.twin, 0), is_leaf=_is_array)
    held = [q for q in layer0 if q[2:] in flat]
    assert held or not any(p[:2] == A for p in items), family
    assert all(raw(layer0[q]).tobytes() == raw(flat[q[2:]]).tobytes() for q in held)


def _is_array(x) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")
