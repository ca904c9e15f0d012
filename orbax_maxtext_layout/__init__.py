"""orbax-maxtext-layout: read and convert Tunix-layout checkpoints into MaxText's layout, and
bridge MaxText steps to and from Hugging Face."""

from ._version import EXAMPLES_DIR, __version__
from .errors import (
    CheckpointReadError,
    LayoutMismatchError,
    OrbaxMaxTextLayoutError,
    ReadOnlyStepError,
    StepExistsError,
    StepLocked,
    UsageError,
)
from .execute.convert import (
    StepReport,
    convert_step,
    converted_provenance,
    to_maxtext_items,
)
from .execute.options import ConvertOptions, MergeOptions
from .execute.restore import restore_as_items
from .execute.verify import VerifyResult, replay_plan, verify_step
from .hf.export_hf import ExportOptions, export_hf
from .hf.export_plan import ExportReport, plan_export
from .hf.import_hf import ImportOptions, ImportReport, import_hf
from .integration.handler import (
    MaxTextLayoutHandler,
    MaxTextLayoutRestore,
    MaxTextLayoutSave,
    load_params_from_path,
)
from .integration.manager import CheckpointManager
from .lora.export_adapter import AdapterReport
from .lora.merge import MergeReport, merge_lora
from .lora.merge_plan import plan_merge
from .model.layer_axes import layer_map, scan_axes
from .model.layermap import SCAN_GROUPS, LayerMap
from .model.lora import LoraAdapters, LoraAdapterStepError
from .model.scan_targets import stack_target, unroll_target
from .model.scan_trees import StackReport, stack, unroll, unstack_layer
from .model.target import KNOWN_INTERMEDIATES, Dest, Target, maxtext_opt_state
from .orbax_io.layout import Layout, detect_layout, tunix_step_number
from .orbax_io.spec import LeafSpec, read_specs
from .orbax_io.stepmeta import TUNIX_STEP_KEY
from .plan.moves import Drop, Move, Op, Plan
from .plan.ops import apply_op
from .plan.rescan import maxtext_forms
from .plan.step_plan import make_plan, narrow, plan_maxtext_step, plan_step
from .plan.steps import StepInfo, find_steps

__all__ = [
    "EXAMPLES_DIR",
    "KNOWN_INTERMEDIATES",
    "SCAN_GROUPS",
    "TUNIX_STEP_KEY",
    "AdapterReport",
    "CheckpointManager",
    "CheckpointReadError",
    "ConvertOptions",
    "Dest",
    "Drop",
    "ExportOptions",
    "ExportReport",
    "ImportOptions",
    "ImportReport",
    "LayerMap",
    "Layout",
    "LayoutMismatchError",
    "LeafSpec",
    "LoraAdapterStepError",
    "LoraAdapters",
    "MaxTextLayoutHandler",
    "MaxTextLayoutRestore",
    "MaxTextLayoutSave",
    "MergeOptions",
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
    "import_hf",
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
