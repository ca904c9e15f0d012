"""Run by test_cli in a fresh process: convert one step (``convert``: a library call;
``command``: as the command line runs it), print peak RSS (KiB) as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import synth
from child import _vm_hwm_kib

from orbax_maxtext_layout import convert_step, plan_step

mode, step, budget = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
target = synth.target_for(step)
plan_step(step, target)  # both modes pay for planning
if mode == "convert":  # a library call: the process's allocator as it was
    convert_step(step, target, memory_budget=budget)
elif mode == "command":  # as the command line runs it, in the process it owns
    from orbax_maxtext_layout.cli.common import owned_process

    with owned_process():
        convert_step(step, target, memory_budget=budget)
print(json.dumps({"peak_rss_kib": _vm_hwm_kib()}))
