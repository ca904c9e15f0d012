"""The one base of the reports an operation returns (`execute.convert.StepReport`,
`lora.merge.MergeReport`, `hf.export_plan.ExportReport`, `lora.export_adapter.AdapterReport`,
`hf.import_hf.ImportReport`): each a dataclass, its fields its dictionary and its JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


class Report:
    """A report's dictionary (`to_dict`: its fields, as `dataclasses.asdict` gives them) and
    its JSON (`to_json`: that dictionary, indented by two). Subclasses are dataclasses and
    keep their own ``__str__``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
