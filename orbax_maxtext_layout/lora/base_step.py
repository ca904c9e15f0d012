"""A MaxText step as the base of ``import-hf --base STEP --adapter`` (issue 60): its params
checked against the model's, and read one slice (one layer, one expert) at a time.

The step is MaxText's layout (``<step>/items``, ``params/params/...``), what ``import-hf``,
``to_maxtext``, MaxText's training or ``merge-lora`` write. Metadata first (`BaseStep.open`:
every param the import writes must be there, with its shape, in a float dtype the import
writes); then each slice is decoded by tensorstore from the stored chunks that hold it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import tensorstore as ts
from etils import epath

from ..base.treepaths import Path
from ..errors import LayoutMismatchError
from ..orbax_io.orbax_files import param_name, sub_kv
from ..orbax_io.reader import ItemReader
from ..orbax_io.spec import read_specs


@dataclasses.dataclass
class BaseStep:
    """A MaxText step's params item, opened (`open`), read slice by slice (`read`)."""

    dir: epath.Path  # the item: ``<step>/items``
    reader: ItemReader
    dtypes: dict[Path, np.dtype]

    @classmethod
    def open(cls, step: epath.PathLike, wanted: Mapping[Path, tuple[int, ...]]) -> BaseStep:
        """``step`` (a step directory or its ``items``) checked: each path of ``wanted``
        (``("params", "params", ...)``) stored with that shape; `LayoutMismatchError` naming
        every one that is missing or of another shape, before any array byte is read."""
        d = epath.Path(step)
        items = d / "items" if (d / "items").exists() else d
        specs = read_specs(items)
        problems = []
        for path, shape in wanted.items():
            spec = specs.get(path)
            if spec is None:
                problems.append(f"{'/'.join(path)}: not in the base step")
            elif tuple(spec.shape) != tuple(shape):
                problems.append(
                    f"{'/'.join(path)}: {list(spec.shape)} in the base step, the model's is "
                    f"{list(shape)}"
                )
            elif np.dtype(spec.dtype).kind != "f" and np.dtype(spec.dtype).name != "bfloat16":
                problems.append(f"{'/'.join(path)}: {spec.dtype}, not a float param")
        if problems:
            raise LayoutMismatchError(
                f"{items} is not a MaxText step of the model of the config:",
                problems,
                hint="Pass the step's own --maxtext-config (model_name, sizes, scan_layers).",
            )
        dtypes = {p: np.dtype(specs[p].dtype) for p in wanted}
        return cls(items, ItemReader.open(items), dtypes)

    def read(self, path: Path, axes: tuple[int, ...], idx: tuple[int, ...]) -> np.ndarray:
        """Param ``path`` at index ``idx`` on its stacked ``axes`` (the whole param for
        none), decoded from the stored chunks that hold it."""
        r = self.reader
        spec = {
            "driver": "zarr3" if r.use_zarr3 else "zarr",
            "kvstore": sub_kv(r.kv.spec().to_json(), param_name(path)),
            # a missing chunk reads as the fill value only where the step says so, as stock
            # Orbax reads it
            "fill_missing_data_reads": r.files.fills_missing,
        }
        array = ts.open(spec, open=True, context=r.context).result()
        # the highest axis first: an integer index drops its axis, and the lower ones keep
        # their numbers
        for axis, i in sorted(zip(axes, idx, strict=True), reverse=True):
            array = array[ts.d[axis][i]]
        return np.asarray(array.read().result())
