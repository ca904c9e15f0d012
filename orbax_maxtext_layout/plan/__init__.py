"""Plans: metadata plus a `model.Target` in, a pure `moves.Plan` out, one `moves.Move` (with
one named `moves.Op`) per written leaf and one `moves.Drop` with its reason per source leaf
left behind. The plan is the dry-run report; writers execute it and `verify` replays it.

- `moves`: the plan's types, the op interface (`moves.Op`) among them;
- `ops`: one class per op, with its numerics (registered on `moves.Op` when this package
  is imported: every `moves.Move` is made with one); the LoRA merge's is in `lora`;
- `step_plan`: a Tunix or MaxText step planned against a target;
- `rescan`: a scan change as a plan transform (a LoRA merge's is in `lora`);
- `provenance`: what a written step records of its plan;
- `steps`, `renumbering`: a run's steps, and which move to MaxText's numbers.

Imports: `model`, `orbax_io`, `storage`, `base`, `errors`. Reads metadata only.
"""

from . import ops as _ops  # noqa: F401  (registers each op on `moves.Op`)
