"""The Hugging Face side: MaxText's hooks (`model.hf_mapping`, its mapping read per layer)
applied to boxes (`hooks_by_box`), the memory budget of a streaming job (`budget`), and both directions:

- out: `export_hf` in front of its plan and report (`export_plan`), its streaming of params
  into the files (`export_stream`) and its processes (`export_processes`), and the adapter
  export (`lora.export_adapter`, a PEFT adapter) when asked; both write through a
  `formats.sink.Sink` (safetensors);
- in: `import_hf` (the step MaxText's ``to_maxtext`` writes, streaming; and the same
  conversion on read, `import_hf.load_params`), reading a Hugging Face directory as
  untrusted input (`formats.safetensors_reader.HfDir`).

Imports: `lora` (the merge, the adapter export), `execute`, `plan`, `model`, `formats`,
`orbax_io`, `storage`, `base`, `errors`; not
`integration` (which reads Hugging Face directories through it).
"""
