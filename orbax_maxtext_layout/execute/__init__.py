"""Plans carried out: into ``<step>/items`` (`write`, with `routing` and `merge_writer`),
into arrays (`restore`), and checked (`verify`); `convert` runs a step's plan end to end with
its `options`, and `legacy_removal` removes a converted step's legacy items once verified.

Imports: `plan`, `model`, `orbax_io`, `storage`, `base`, `errors`.
"""
