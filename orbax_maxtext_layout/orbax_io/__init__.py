"""Orbax's formats, read and written: what a checkpoint says about itself and how its bytes
become arrays.

- `orbax_files`: an item's JSON files (``_METADATA``, ``_sharding``, array metadata);
- `stepmeta`: a step's ``_CHECKPOINT_METADATA``;
- `layout`: which layout a step directory is (Tunix or MaxText), from names alone;
- `stepdir`: a step directory as a unit of work (temporary item, atomic commit);
- `spec`: each leaf's shape, dtype and chunking, from metadata only;
- `tskv`: OCDBT databases and tensorstore: the item reader (`SourceItem`) every operation
  that reads array bytes goes through, and the writer of new arrays;
- `chunks`: each stored chunk decoded once, in pieces, within a memory budget.

Imports: `storage`, `base`, `errors`. Knows nothing of models, plans or Hugging Face.
"""
