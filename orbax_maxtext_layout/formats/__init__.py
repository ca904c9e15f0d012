"""File formats other than Orbax's, read and written: the tensors of a Hugging Face model.

- `sink`: the seam every written format implements, `Sink` (files laid out from metadata,
  each part opened, written by name or by box, closed or abandoned, then the index and the
  config published last), with `Tensor`, `Part` and `PartWriter`; a new format is one
  module implementing it;
- `safetensors_writer`: safetensors files written in place, header first
  (`SafetensorsSink`, `ShardFile`), as MaxText's ``to_huggingface`` shards them;
- `safetensors_reader`: a Hugging Face directory of safetensors read as untrusted input
  (`HfDir`: its config, index and every header checked, every path kept inside the
  directory, before a byte of data is read; `HfInputError`).

Imports: `storage`, `base`, `errors`. Beside `orbax_io` on its floor, importing nothing of
it: knows nothing of Orbax, models, plans or MaxText's mapping.
"""
