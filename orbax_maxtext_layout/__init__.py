"""orbax-maxtext-layout: read and convert Tunix-layout checkpoints into MaxText's layout."""

from ._version import EXAMPLES_DIR, __version__
from .convert import (
    MergeReport,
    StepReport,
    convert_step,
    converted_provenance,
    merge_lora,
    to_maxtext_items,
)
from .errors import (
    CheckpointReadError,
    LayoutMismatchError,
    OrbaxMaxTextLayoutError,
    ReadOnlyStepError,
    StepExistsError,
    StepLocked,
    UsageError,
)
from .export_adapter import AdapterReport
from .export_hf import ExportReport, export_hf, plan_export
from .handler import (
    MaxTextLayoutHandler,
    MaxTextLayoutRestore,
    MaxTextLayoutSave,
    load_params_from_path,
)
from .layermap import LayerMap
from .layout import Layout, detect_layout, tunix_step_number
from .lora import LoraAdapters, LoraAdapterStepError
from .manager import CheckpointManager
from .merge import plan_merge
from .moves import Drop, Move, Op, apply_op
from .plan import Plan, make_plan, narrow, plan_maxtext_step, plan_step
from .rescan import maxtext_forms
from .restore import restore_as_items
from .scan import (
    SCAN_GROUPS,
    StackReport,
    layer_map,
    scan_axes,
    stack,
    stack_target,
    unroll,
    unroll_target,
    unstack_layer,
)
from .spec import LeafSpec, read_specs
from .stepmeta import TUNIX_STEP_KEY
from .steps import StepInfo, find_steps
from .target import KNOWN_INTERMEDIATES, Dest, Target, maxtext_opt_state
from .verify import VerifyResult, replay_plan, verify_step

__all__ = [
    "EXAMPLES_DIR",
    "KNOWN_INTERMEDIATES",
    "SCAN_GROUPS",
    "TUNIX_STEP_KEY",
    "AdapterReport",
    "CheckpointManager",
    "CheckpointReadError",
    "Dest",
    "Drop",
    "ExportReport",
    "LayerMap",
    "Layout",
    "LayoutMismatchError",
    "LeafSpec",
    "LoraAdapterStepError",
    "LoraAdapters",
    "MaxTextLayoutHandler",
    "MaxTextLayoutRestore",
    "MaxTextLayoutSave",
    "MergeReport",
    "Move",
    "Op",
    "OrbaxMaxTextLayoutError",
    "Plan",
    "ReadOnlyStepError",
    "StackReport",
    "StepExistsError",
    "StepInfo",
    "StepLocked",
    "StepReport",
    "Target",
    "UsageError",
    "VerifyResult",
    "__version__",
    "apply_op",
    "convert_step",
    "converted_provenance",
    "detect_layout",
    "export_hf",
    "find_steps",
    "layer_map",
    "load_params_from_path",
    "make_plan",
    "maxtext_forms",
    "maxtext_opt_state",
    "merge_lora",
    "narrow",
    "plan_export",
    "plan_maxtext_step",
    "plan_merge",
    "plan_step",
    "read_specs",
    "replay_plan",
    "restore_as_items",
    "scan_axes",
    "stack",
    "stack_target",
    "to_maxtext_items",
    "tunix_step_number",
    "unroll",
    "unroll_target",
    "unstack_layer",
    "verify_step",
]
