"""What a resumed MaxText run does through the library's manager, on ``gs://`` or a disk.

``python -m gcs.manager_job DIR TEMPLATE`` (or `cycle` in-process): restores every legacy
(Tunix-layout) step of ``DIR`` as MaxText items against the target of ``TEMPLATE`` (a
MaxText-layout step of the same model), then saves the next step. The save moves each
restored legacy step to its MaxText number and, once committed, migrates it there
(``remove_legacy=True``). Public APIs only.
"""

from __future__ import annotations

import sys

import orbax.checkpoint as ocp
from etils import epath

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.integration.manager import CheckpointManager


def cycle(directory: str, template: str, *, use_async: bool = False) -> list[int]:
    """Restore the legacy steps, save the next step; returns the steps listed afterwards."""
    directory_path = epath.Path(directory)
    abstract = oml.Target.from_checkpoint(epath.Path(template)).items()
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=use_async)
    with CheckpointManager(
        directory_path, item_names=("items",), options=options, remove_legacy=True
    ) as mngr:
        legacy = [
            oml.tunix_step_number(s.path) - 1
            for s in oml.find_steps(directory_path, roles=False)
            if s.layout is oml.Layout.TUNIX
        ]
        items = None
        for step in sorted(legacy):
            args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=abstract))
            items = mngr.restore(step, args=args)["items"]
        if items is not None:
            nxt = max(mngr.all_steps()) + 1
            mngr.save(nxt, args=ocp.args.Composite(items=ocp.args.PyTreeSave(items)), force=True)
            mngr.wait_until_finished()
        return mngr.all_steps()


def run(directory: str, template: str) -> int:
    """The job as ``python -m gcs.manager_job DIR TEMPLATE`` runs it (forked children call
    this: `forked_cli.run_call`)."""
    cycle(directory, template)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2]))
