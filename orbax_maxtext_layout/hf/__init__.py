"""The Hugging Face side: MaxText's own mapping read per layer (`hf_mapping`), its hooks
applied to boxes (`piecewise`), the memory budget of a streaming job (`budget`), and both directions:

- out: the safetensors sink (`safetensors_out`), `export_hf` in front of its plan and report
  (`export_plan`), its streaming of params into the shards (`export_stream`) and its
  processes (`export_processes`); `export_adapter` (a PEFT adapter);
- in: a Hugging Face directory read as untrusted input (`safetensors_in`: every header and
  path checked before a byte of data is read), and `import_hf` (the step MaxText's
  ``to_maxtext`` writes, streaming; and the same conversion on read, `import_hf.load_params`).

Imports: `lora` (the adapter's factors), `execute`, `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`; not
`integration` (which reads Hugging Face directories through it).
"""
