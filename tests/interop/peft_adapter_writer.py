"""Child for test_import_adapter.py, run in the hf venv (transformers 5, peft 0.21.2, CPU torch;
``OMTL_HF_PYTHON``): PEFT adapters made by PEFT itself, and PEFT's own merge of each.

    python peft_adapter_writer.py SPEC_JSON

``SPEC_JSON``: a JSON list of ``{"name", "family", "seed", "lora": {LoraConfig keyword
arguments}, "out": DIR}``. For each: the tiny base of ``family`` (import_hf_writer's config and
seeded values, float32) saved to ``DIR/base`` with ``save_pretrained``; ``get_peft_model`` with
``LoraConfig(**lora)``; every LoRA factor overwritten with seeded normal values times 0.3 (PEFT
starts ``lora_B`` at zero, which would move nothing); the adapter saved to ``DIR/adapter``
(``save_pretrained``); ``merge_and_unload()``'s model saved to ``DIR/merged``. Prints one JSON
line per spec: the adapter's tensor names and shapes, its config, and the largest change the
merge made to any base tensor (``moved``), so a test knows the adapter does something.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import import_hf_writer as W


def write(spec: dict) -> dict:
    import torch
    import transformers as T
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open

    out = Path(spec["out"])
    cfg = W._config(spec["family"])
    torch.manual_seed(spec["seed"])
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.5)
    model.save_pretrained(str(out / "base"))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    peft = get_peft_model(model, LoraConfig(**spec["lora"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.3)
    peft.save_pretrained(str(out / "adapter"))
    merged = peft.merge_and_unload()
    moved = max(
        float((v - before[k]).abs().max()) for k, v in merged.state_dict().items() if k in before
    )
    merged.save_pretrained(str(out / "merged"))
    tensors = {}
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), framework="pt") as st:
        for k in st.keys():
            tensors[k] = list(st.get_slice(k).get_shape())
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    return {"name": spec["name"], "tensors": tensors, "config": config, "moved": moved}


def main(argv: list[str]) -> None:
    for spec in json.loads(argv[0]):
        print(json.dumps(write(spec)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    gc.freeze()  # exit without walking the heap torch and transformers left
