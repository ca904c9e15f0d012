"""What the model says: the abstract `Target` a step is checked and split against, MaxText's
config read as its train loop reads it (`maxtext_config`, the only place MaxText's config
is imported), the layer map of scans (`layermap`), scanned blocks and their axes (`scan`),
RNG state (`rng`), LoRA adapter steps (`lora`), and the named tree rules (`rules`).

The model decides which leaf is a weight and which subtree is a scan over which axis; no
name pattern does.

Imports: `orbax_io` (leaf specs), `base`, `errors`.
"""
