"""The Hugging Face side: MaxText's own mapping read per layer (`hf_mapping`), its hooks
applied to boxes (`piecewise`), LoRA factors carried through them (`adapter_factors`),
the safetensors sink (`safetensors_out`), and the exports (`export_hf`, `export_adapter`).

Imports: `execute`, `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`; not
`integration`.
"""
