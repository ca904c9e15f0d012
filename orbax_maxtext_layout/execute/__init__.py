"""Plans carried out: into ``<step>/items`` (`write`, with `source_walk`; an op written its own way,
a LoRA merge, writes itself: its op's `write_rest`),
into arrays (`restore`), and checked (`verify`); `convert` runs a step's plan end to end with
its `options`, and `legacy_removal` removes a converted step's legacy items once verified.

Imports: `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`. A step written by a room
above (a LoRA merge) is replayed through `verify.REPLAYS`, which that room fills in.
"""
