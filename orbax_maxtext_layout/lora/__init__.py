"""LoRA in one room (issue 59): what an adapter's factors are and where they go.

- `peft_adapter`: a PEFT LoRA adapter (``adapter_config.json`` and its factors) read as
  untrusted input and planned against a Hugging Face base: every factor pair mapped to the
  base tensor it changes, with PEFT's own scale for its module, or refused by name; and the
  merge ``W + s·B@A`` in float32 that ``import-hf --adapter`` applies to a source tensor.

Sits between `execute` and `hf`: the Hugging Face side (the adapter export, the import of a
PEFT adapter) builds on it; the floors below reach LoRA only through the plan's op interface,
never by importing this room.

Imports: `execute`, `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`; not `hf`,
`integration`.
"""
