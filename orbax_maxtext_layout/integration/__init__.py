"""The Orbax faces: `handler.MaxTextLayoutHandler` (restores either layout as MaxText items),
`manager.CheckpointManager` (Orbax's v0 manager reading both layouts, with lazy migration),
and `legacy_steps.LegacySteps` (what a manager does with Tunix-layout steps). The v1
`training.Checkpointer` and the MaxText runner (`maxtext`) sit at the top, on these.

Imports: `hf` (a Hugging Face directory read as a checkpoint), `execute`, `plan`, `model`,
`orbax_io`, `storage`, `base`, `errors`.
"""
