"""orbax-maxtext-layout: read and convert Tunix-layout checkpoints into MaxText's layout."""

from ._version import EXAMPLES_DIR, __version__
from .convert import (
    StepReport,
    convert_step,
    converted_provenance,
    plan_step,
    restore_as_items,
    to_maxtext_items,
)
from .errors import CheckpointReadError, LayoutMismatchError
from .handler import (
    MaxTextLayoutHandler,
    MaxTextLayoutRestore,
    MaxTextLayoutSave,
    load_params_from_path,
)
from .layout import Layout, StepInfo, detect_layout, find_steps
from .lock import ReadOnlyStepError, StepLocked
from .manager import TUNIX_STEP_KEY, CheckpointManager
from .plan import Plan, make_plan
from .scan import (
    SCAN_GROUPS,
    StackReport,
    scan_axes,
    stack,
    stack_target,
    unroll,
    unroll_target,
    unstack_layer,
)
from .spec import LeafSpec, read_specs
from .target import KNOWN_INTERMEDIATES, Dest, Target, maxtext_opt_state
from .verify import VerifyResult, verify_step

__all__ = [
    "EXAMPLES_DIR",
    "KNOWN_INTERMEDIATES",
    "SCAN_GROUPS",
    "TUNIX_STEP_KEY",
    "CheckpointManager",
    "CheckpointReadError",
    "Dest",
    "Layout",
    "LayoutMismatchError",
    "LeafSpec",
    "MaxTextLayoutHandler",
    "MaxTextLayoutRestore",
    "MaxTextLayoutSave",
    "Plan",
    "ReadOnlyStepError",
    "StackReport",
    "StepInfo",
    "StepLocked",
    "StepReport",
    "Target",
    "VerifyResult",
    "__version__",
    "convert_step",
    "converted_provenance",
    "detect_layout",
    "find_steps",
    "load_params_from_path",
    "make_plan",
    "maxtext_opt_state",
    "plan_step",
    "read_specs",
    "restore_as_items",
    "scan_axes",
    "stack",
    "stack_target",
    "to_maxtext_items",
    "unroll",
    "unroll_target",
    "unstack_layer",
    "verify_step",
]
