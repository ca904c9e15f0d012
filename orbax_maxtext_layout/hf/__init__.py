"""The Hugging Face side: MaxText's own mapping read per layer (`hf_mapping`), its hooks
applied to boxes (`piecewise`), the memory budget of a streaming job (`budget`), and both directions:

- out: `export_hf` in front of its plan and report (`export_plan`), its streaming of params
  into the files (`export_stream`) and its processes (`export_processes`); `export_adapter`
  (a PEFT adapter); both write through a `formats.sink.Sink` (safetensors);
- in: `import_hf` (the step MaxText's ``to_maxtext`` writes, streaming; and the same
  conversion on read, `import_hf.load_params`), reading a Hugging Face directory as
  untrusted input (`formats.safetensors_reader.HfDir`).

Imports: `lora` (the adapter's factors and the merge), `execute`, `plan`, `model`, `formats`,
`orbax_io`, `storage`, `base`, `errors`; not
`integration` (which reads Hugging Face directories through it).
"""
