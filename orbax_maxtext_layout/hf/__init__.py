"""The Hugging Face side: MaxText's own mapping read per layer (`hf_mapping`), its hooks
applied to boxes (`piecewise`), LoRA factors carried through them (`adapter_factors`),
the safetensors sink (`safetensors_out`), the memory budget of a streaming job (`budget`),
and the exports: `export_hf` in front of its plan and report (`export_plan`), its streaming
of params into the shards (`export_stream`) and its processes (`export_processes`); and
`export_adapter`.

Imports: `execute`, `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`; not
`integration`.
"""
