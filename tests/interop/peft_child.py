"""The PEFT side of test_export_adapter.py, run by the hf venv's Python 3.11 (constraints/hf.txt:
transformers 5.24.0, peft 0.21.2, the CPU build of torch 2.13.0), never imported by pytest.

    python peft_child.py JOBS.json OUT.npz

JOBS.json: ``{"tokens": [[...], ...], "jobs": [{"name", "base", "merged", "adapter"}, ...]}``,
each a directory: ``base`` and ``merged`` Hugging Face models (``export-hf`` of the base step
and of the LoRA step merged into it), ``adapter`` a PEFT adapter (``export-hf --adapter``).
For each job, in float32, without a cache, under ``torch.no_grad()``:

- ``<name>::base``, ``<name>::merged``: transformers' logits of the two models;
- ``<name>::peft``: the logits of ``PeftModel.from_pretrained(<base model>, adapter)``;
- ``<name>::info`` (JSON): the adapter's tensors that PEFT did not load as they are in the
  file (``not_loaded``: none is expected), the modules that hold a LoRA layer
  (``adapted``), the modules the file holds factors for (``file_modules``), PEFT's warnings
  while loading (``warnings``), the config's ``target_modules``, and per weight the largest
  difference between ``merge_and_unload()``'s weight and the merged model's
  (``merge_diff``).

"As they are in the file" is after PEFT's own conversion for transformers 5
(``convert_peft_adapter_state_dict_for_transformers``, what ``PeftModel.from_pretrained``
applies): the identity for llama and gemma3; for mixtral, whose experts transformers 5 fuses
into 3-D parameters, it stacks the file's per-expert factors into the LoRA of those
parameters (PEFT's ``ParamWrapper``: ``experts.base_layer`` for ``gate_up_proj``, rank 2r,
``experts`` for ``down_proj``) and renames ``block_sparse_moe`` to ``mlp``. ``file_modules``
are the converted tensors' modules: those PEFT must adapt.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import numpy as np
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def _model(path: str, info: dict | None = None) -> torch.nn.Module:
    model, loading = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    if info is not None:
        info.update(loading)
    return model.eval()


def _converted(peft: PeftModel, path: str) -> dict[str, torch.Tensor]:
    """The adapter file's tensors as PEFT loads them (see the module's docstring)."""
    from peft.utils.transformers_weight_conversion import (
        convert_peft_adapter_state_dict_for_transformers,
    )

    tensors = load_file(f"{path}/adapter_model.safetensors")
    return convert_peft_adapter_state_dict_for_transformers(
        peft, peft.peft_config["default"], tensors, adapter_name="default"
    )


def run(job: dict, tokens: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {}
    with torch.no_grad():
        out["base"] = _model(job["base"])(tokens, use_cache=False).logits.numpy()
        loading: dict = {}
        merged = _model(job["merged"], loading)
        out["merged"] = merged(tokens, use_cache=False).logits.numpy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft = PeftModel.from_pretrained(_model(job["base"]), job["adapter"])
        peft.eval()
        out["peft"] = peft(tokens, use_cache=False).logits.numpy()
    state = peft.state_dict()
    converted = _converted(peft, job["adapter"])
    not_loaded = []
    for name, value in converted.items():
        key = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        if key not in state or not torch.equal(state[key], value):
            not_loaded.append(name)
    adapted = sorted(n for n, m in peft.named_modules() if hasattr(m, "lora_A") and len(m.lora_A))
    config = json.loads(open(f"{job['adapter']}/adapter_config.json").read())
    unloaded = peft.merge_and_unload()
    want = merged.state_dict()
    # The exported weights only (as transformers names them once loaded: mixtral's experts
    # fused): a class with more than the export holds (gemma3's vision tower) initialises the
    # rest at random, differently in each of the two models.
    missing = set(loading["missing_keys"])
    merge_diff = {
        n: float((p.detach() - want[n]).abs().max())
        for n, p in unloaded.state_dict().items()
        if n in want and n not in missing
    }
    info = {
        "not_loaded": not_loaded,
        "adapted": adapted,
        # the modules the adapter file holds factors for, and PEFT's warnings on loading it
        "file_modules": sorted(
            {n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in converted}
        ),
        "warnings": [str(w.message) for w in caught],
        "target_modules": config["target_modules"],
        "merge_diff": merge_diff,
    }
    out["info"] = json.dumps(info)
    return out


def main(jobs_path: str, out_path: str) -> None:
    spec = json.loads(open(jobs_path).read())
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    out = {}
    for job in spec["jobs"]:
        for k, v in run(job, tokens).items():
            out[f"{job['name']}::{k}"] = v if isinstance(v, np.ndarray) else np.array(v)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    gc.freeze()  # exit without walking the heap torch and transformers left
