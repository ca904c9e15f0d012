"""Run by test_cli in a fresh process: convert one step, print peak RSS (KiB) as JSON."""

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
if mode == "convert":
    convert_step(step, target, memory_budget=budget)
print(json.dumps({"peak_rss_kib": _vm_hwm_kib()}))
