"""What the model says: the abstract `Target` a step is checked and split against, MaxText's
config read as its train loop reads it (`maxtext_config`, the only place MaxText's config
is imported), the layer map of scans (`layermap`), the layer axis of each leaf
(`layer_axes`), unroll and stack of trees of values (`scan_trees`) and of targets
(`scan_targets`), RNG state (`rng`), LoRA adapter steps (`lora`), the named tree rules
(`rules`), and MaxText's own Hugging Face mapping read per layer (`hf_mapping`, the only
place MaxText's mappings are called; below `lora` and `hf`, which both export through it).

The model decides which leaf is a weight and which subtree is a scan over which axis; no
name pattern does.

Imports: `orbax_io` (leaf specs), `base`, `errors`.
"""
