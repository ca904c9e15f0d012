"""LoRA in one room (issue 59): an adapter's factors, their scale and where they go.

- `merge_op`: the merge as an op (``merge_lora``, a `plan.moves` op): what it reads (the
  base and each layer's factors), what it writes, how it applies to a leaf, a layer and a
  box; `delta`: its numerics (``W + scale * reshape(A @ B, W.shape)``, by layer or by box);
- `merge_plan`: a merge as a plan transform (`plan_merge`: the adapter step read, each
  adapted weight's move made a merge; `replay_merge` for `verify_step`);
- `merge_writer`: the merges written layer by layer, within a memory bound;
- `merge`: `merge_lora` end to end, with its `MergeReport`;
- `adapter_factors`: a LoRA module's factors carried through MaxText's Hugging Face hooks
  onto PEFT's factors (the adapter export's mapping, checked on a real layer);
- `export_adapter`: an adapter step written as a PEFT adapter, through a `formats` sink.
- `peft_adapter`: a PEFT LoRA adapter (``adapter_config.json`` and its factors) judged and
  planned against a Hugging Face base: every factor pair mapped to the base tensor it
  changes, with PEFT's own scale for its module, or refused by name; and the merge
  ``W + s·B@A`` in float32 that ``import-hf --adapter`` applies to a source tensor;
- `base_step`: a MaxText step as the base of ``import-hf --base STEP --adapter``, checked
  against the model and read one slice at a time.
- `peft_as_lora`: a PEFT adapter written, not merged, as the Tunix LoRA step ``train_sft``
  resumes from (``import-hf --adapter --as-lora``): each weight's factors carried through
  MaxText's import hooks into qwix's, smaller ranks zero-padded and scale ratios folded into
  ``b``, checked against the hooked PEFT delta, written as ``<out>/0/model_params``.

Sits between `execute` and `hf`: the Hugging Face side (the merged export, the import of a
PEFT adapter) builds on it. The floors below reach LoRA only through
the plan's op interface and `execute.verify.REPLAYS`, never by importing this room; both
are filled in when it is imported (below), which the package's ``__init__`` does. Reading
an adapter step's metadata stays in `model.lora`, below `plan` (listing steps and refusing
a LoRA-only step to a plain conversion need it).

Imports: `execute`, `plan`, `model`, `formats`, `orbax_io`, `storage`, `base`, `errors`; not `hf`,
`integration`.
"""

from . import merge_plan as _merge_plan  # noqa: F401  (registers the merge op and its replay)
