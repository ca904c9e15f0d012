"""The transformers side of test_export_hf_logits.py, run by the hf venv's Python 3.11
(constraints/hf.txt: transformers 5.24.0 and the CPU build of torch 2.13.0), never imported
by pytest. Imports numpy, torch and transformers only (the hf venv has nothing else).

    python hf_logits_child.py JOBS.json OUT.npz

JOBS.json: ``{"tokens": [[...], ...], "jobs": [{"name", "dir", "variant"}, ...]}``. For each
job: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`` with
``output_loading_info=True``, ``eval()``, one forward pass on the tokens without a cache, under
``torch.no_grad()``. Variants:

- ``plain``: the model as loaded; logits as transformers computes them.
- ``bf16_head``: the same forward, but the logits are the final hidden states (after the
  model's final norm) times the output head's weight **rounded to bfloat16**, in float32.
  This is what MaxText 0.2.5 computes for a model with tied embeddings
  (``logits_via_embedding``): its ``attend_on_embedding`` casts the embedding table to
  bfloat16 whatever ``dtype``/``weight_dtype`` say. The child checks first that the same
  product with the unrounded weight reproduces transformers' own logits.
- ``qk_interleaved``: before the forward, every ``q_proj``/``k_proj`` weight's rows are put
  back from Hugging Face's rotate-half order into the interleaved (pairwise) order, per
  head: an export that forgot the RoPE permutation. Only a check that the test can fail.
- ``rope_default``: ``config.json``'s ``rope_parameters`` replaced by plain RoPE of the same
  theta (llama3.1's frequency scaling dropped): a config that is wrong where the tensors are
  right. Only a check that the test can fail.

OUT.npz: ``<name>`` -> float32 logits ``(batch, length, vocab)``; ``<name>::info`` -> a JSON
string with the model class, ``tie_word_embeddings``, the loading info (missing, unexpected and
mismatched keys, error messages) and, for ``bf16_head``, the check above.
"""

from __future__ import annotations

import gc
import json
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def interleave_qk(model: torch.nn.Module) -> list[str]:
    """Rows of each q/k projection, per head, from [x_0..x_{h-1}, y_0..y_{h-1}] to
    [x_0, y_0, x_1, y_1, ...] (``h`` = head_dim / 2)."""
    cfg = model.config
    head_dim = cfg.head_dim
    done = []
    for name, p in model.named_parameters():
        if not name.endswith(("q_proj.weight", "k_proj.weight")):
            continue
        rows, cols = p.shape
        heads = rows // head_dim
        w = p.detach().reshape(heads, 2, head_dim // 2, cols).transpose(1, 2)
        with torch.no_grad():
            p.copy_(w.reshape(rows, cols))
        done.append(name)
    assert done, "no q_proj/k_proj weights"
    return done


def run_job(job: dict, tokens: torch.Tensor) -> tuple[np.ndarray, dict]:
    variant = job["variant"]
    kwargs = {}
    if variant == "rope_default":
        config = AutoConfig.from_pretrained(job["dir"])
        theta = config.rope_parameters["rope_theta"]
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        kwargs["config"] = config
    model, loading = AutoModelForCausalLM.from_pretrained(
        job["dir"], dtype=torch.float32, output_loading_info=True, **kwargs
    )
    model.eval()
    info = {
        "class": type(model).__name__,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "loading": {k: sorted(map(str, v)) for k, v in loading.items()},
    }
    if variant == "rope_default":
        info["rope_parameters"] = dict(model.config.rope_parameters)
    if variant == "qk_interleaved":
        info["interleaved"] = interleave_qk(model)
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False)
        logits = out.logits.float()
        if variant == "bf16_head":
            # The last hidden state is after the final norm (the output head's input).
            hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state
            head = model.get_output_embeddings().weight
            same = hidden @ head.T
            info["head_reproduces_logits"] = float((same - logits).abs().max())
            logits = hidden @ head.to(torch.bfloat16).to(torch.float32).T
    return logits.numpy().astype(np.float32), info


def main(jobs_path: str, out_path: str) -> None:
    spec = json.loads(open(jobs_path).read())
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    out: dict[str, np.ndarray] = {}
    for job in spec["jobs"]:
        logits, info = run_job(job, tokens)
        out[job["name"]] = logits
        out[f"{job['name']}::info"] = np.array(json.dumps(info))
        print(f"hf logits {job['name']}: {logits.shape} {info['class']}", flush=True)
    np.savez(out_path, **out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOBS.json OUT.npz")
    torch.manual_seed(0)
    main(sys.argv[1], sys.argv[2])
    gc.freeze()  # exit without walking the heap torch and transformers left
