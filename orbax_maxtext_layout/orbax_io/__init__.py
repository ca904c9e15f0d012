"""Orbax's formats, read and written: what a checkpoint says about itself and how its bytes
become arrays.

- `orbax_files`: an item's JSON files (``_METADATA``, ``_sharding``, array metadata) and
  its key-value store's opening;
- `stepmeta`: a step's own metadata file (its one reader and writer);
- `layout`: which layout a step directory is (Tunix or MaxText), from names alone;
- `stepdir`: a step directory as a unit of work (temporary item, atomic commit);
- `spec`: each leaf's shape, dtype and chunking, from metadata only;
- `reader`: **the item reader**, `ItemReader`, opened once per item with its store handed
  in; every operation that reads array bytes reads through it (metadata, each stored
  chunk's pieces, whole values, stored bytes);
- below it: `ocdbt` (the B-tree: where each value lies, every path checked, and the bytes
  of the small values stored inline in it), `zarr` (an array's stored `ChunkLayout`, its
  metadata checked), `stored_values` (a stored value read piece by piece: from its data file,
  from the B-tree, or through the kvstore) and `chunks` (the decoder: each stored chunk
  decoded once, in pieces);
- `item_writer`: a new item's arrays (grafts, chunk copies, tensorstore writes).

Imports: `storage`, `base`, `errors`. Knows nothing of models, plans or Hugging Face.
"""
