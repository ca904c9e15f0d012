"""LoRA in one room (issue 59): what an adapter's factors are and where they go.

- `adapter_factors`: a LoRA module's factors carried through MaxText's Hugging Face hooks
  onto PEFT's factors (the adapter export's mapping, checked on a real layer).

Sits between `execute` and `hf`: the Hugging Face side (the adapter export, the import of a
PEFT adapter) builds on it; the floors below reach LoRA only through the plan's op interface
(`plan.moves.Op`), never by importing this room.

Imports: `execute`, `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`; not `hf`,
`integration`.
"""
