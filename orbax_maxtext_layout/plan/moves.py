"""What a conversion writes: one `Move` per destination leaf, each with one named op.

A `Plan` is a list of moves plus the source leaves deliberately left behind
(`Drop`, each with its reason). Like a Hugging Face weight conversion, every
destination leaf is described by a small named operation on its source leaves:

======== =====================================================================
op       destination leaf (the op's own parameters, its ``args``)
======== =====================================================================
copy     the source leaf, stored bytes unchanged (PRNG keys keep their impl)
cast     the source leaf cast to ``dtype`` (``step``: uint32 -> int32)
constant ``value``, no source (``step`` from the step directory's number)
slice    layer ``index`` of a stacked source, taken on ``axis`` (unroll)
stack    the sources (one per layer, ``layers``) joined on ``axis`` (stack); a
         ``None`` layer is RNG state the source never had, initialised fresh
fresh    no source: RNG state initialised fresh (count 0, a derived key; with
         ``axis``, a stacked leaf whose layers are derived one by one, as for stack)
merge_lora  a base weight plus its LoRA delta, per layer ``l``:
         ``W_l + scale * reshape(A_l @ B_l, W_l.shape)`` (``lora``: the factors of
         each layer, in another item); the base layer comes as for copy, slice
         (``index``) or stack (``layers``), on ``axis``
======== =====================================================================

Each op's parameters are its own frozen dataclass (``op.Args``: `plan.ops.CastArgs`, ...,
`lora.merge_op.MergeArgs`), carried by the move as ``args``: the move holds only what every
move has.

The same plan drives the dry-run report, the writer, the in-memory restore and
`verify`, which checks every written leaf against `apply_op` of its sources.

This module holds the types alone (as optax's ``base``): the moves, the plan and the op
interface (`Op`). Each op's class, with its numerics, is in `plan.ops`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..base.step_entries import Dest
from ..base.treepaths import Path, keystr
from ..errors import LayoutMismatchError
from ..orbax_io.spec import LeafSpec


class Op:
    """The op interface: what a destination leaf is made by. One class per op (`plan.ops`;
    the LoRA merge's in `lora`), one instance each, registered here as ``Op.COPY``, ...
    (the enum's spelling: ``name`` ``"COPY"``, ``value`` ``"copy"``, what reports print).
    Callers ask the op (what it reads, what it writes, how it applies to a box) instead of
    branching on which op it is; what one move of it needs besides (an axis, a layer, a
    value) is the op's own parameters, an ``Args`` the move carries (``Move.args``)."""

    name: ClassVar[str] = ""
    # The type of this op's parameters (`Move.args`); an op that has none takes `NoArgs`.
    Args: ClassVar[type] = None  # type: ignore[assignment]  # `NoArgs`, set below
    # The written leaf is its one source leaf's stored bytes, renamed only: grafted, never
    # decoded (`execute.write`), compared key by key (`execute.verify`).
    renames: ClassVar[bool] = False
    # The written leaf is its one source leaf, element for element (a copy, a cast): a
    # restore reads it straight into the destination's sharding.
    elementwise: ClassVar[bool] = False
    # Moves values without combining them: routed piece by piece (`parts`).
    routed: ClassVar[bool] = False
    # No source: made, not read (`apply` with no reader).
    made: ClassVar[bool] = False

    COPY: ClassVar[Op]
    CAST: ClassVar[Op]
    CONSTANT: ClassVar[Op]
    SLICE: ClassVar[Op]
    STACK: ClassVar[Op]
    FRESH: ClassVar[Op]
    MERGE_LORA: ClassVar[Op]

    @property
    def value(self) -> str:
        """The op's name in reports and JSON (``copy``, ``merge_lora``, ...)."""
        return self.name.lower()

    def __repr__(self) -> str:
        return f"<Op.{self.name}: {self.value!r}>"

    def __reduce__(self) -> str:
        return self.name  # one instance per op: unpickled as the module's own (`plan.ops`)

    # -- the plan's view: what it reads and writes ---------------------------------------
    @property
    def unrolled(self) -> Op | None:
        """The op that writes one layer of this op's stacked leaf (None: it cannot)."""
        return None

    @property
    def stacked(self) -> Op:
        """The op that writes the layers of this op's leaves stacked into one."""
        return Op.STACK

    def unroll(self, m: Move, *, dst: Path, axis: int, index: int) -> Move:
        """The move writing layer ``index`` on ``axis`` of the stacked leaf ``m`` writes, at
        ``dst``: this op's `unrolled` op (a slice) of that layer."""
        op = self.unrolled
        assert op is not None, m
        return dataclasses.replace(m, dst=dst, op=op, args=op.Args(axis=axis, index=index))

    def stack_layers(
        self, got: Mapping[int, Move], n: int, *, dst: Path, axis: int, note: str
    ) -> Move | str:
        """The move writing ``n`` layers stacked on ``axis`` at ``dst``, from this op's moves of
        one layer each (``got``: by layer; a missing one is fresh RNG state, ``note`` says
        which); or why they do not stack."""
        first = got[min(got)]
        srcs = tuple(got[i].src if i in got else None for i in range(n))
        op = self.stacked
        return dataclasses.replace(
            first, dst=dst, op=op, args=op.Args(axis=axis, layers=srcs), note=note
        )

    def sources(self, m: Move) -> tuple[Path, ...]:
        """The source leaves ``m`` reads (all in ``m.item``)."""
        return (m.src,)

    def reads(self, m: Move) -> tuple[tuple[str, Path, LeafSpec], ...]:
        """Every source leaf ``m`` reads, as ``(item, path, stored spec)``."""
        return tuple((m.item, p, m.spec) for p in self.sources(m))

    def factors(self, m: Move) -> tuple[LoraFactor, ...]:
        """The LoRA factors ``m`` adds to its base, one per layer or one for all (a
        merge's); none for every other op."""
        return ()

    def out_spec(self, m: Move) -> LeafSpec:
        """The stored form of the leaf ``m`` writes."""
        return m.spec

    def detail(self, m: Move) -> str:
        """What a report adds after ``op(sources)``."""
        return ""

    # -- the numerics (each op's own, in `plan.ops`) ---------------------------------------
    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        """The leaf ``m`` writes in stored form (keys as raw data), from ``read``."""
        raise NotImplementedError(self.value)

    def assemble(self, m: Move, read: Callable[[str, Path], Any]) -> Any:
        """The leaf ``m`` writes, from host leaves ``read`` gives as they are (a restore);
        a copy hands its leaf on as given."""
        return self.apply(m, lambda item, p: np.asarray(read(item, p)))

    def parts(
        self, m: Move, path: Path, start: tuple[int, ...], data: np.ndarray, factors: LayerReader
    ) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """What a box of source leaf ``path`` (at ``start``, holding ``data``) puts in the
        leaf ``m`` writes: ``(start in the written leaf, values)``. A chunk-once writer or
        check walks each source's stored chunks once and routes every box through this;
        ``factors`` reads the layers of what else a box combines with (a merge's factors)."""
        raise ValueError(f"{self.value} is not routed by pieces")

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the box a piece of a source of ``m`` (``piece`` long) puts in the
        leaf ``m`` writes."""
        return piece

    def splits(self, m: Move, piece: tuple[int, ...]) -> bool:
        """Whether an op that combines values can still be computed box by box, for pieces
        of its source of shape ``piece``."""
        return False

    def made_parts(self, m: Move) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """The parts of the leaf ``m`` writes that no source gives (fresh RNG layers), as
        `parts` gives them."""
        return iter(())

    def makes_parts(self, m: Move) -> bool:
        """Whether `made_parts` gives anything."""
        return False

    def chunk_shape(self, m: Move) -> tuple[int, ...]:
        """The chunk shape a decoded leaf is written with (one chunk)."""
        return m.out_spec.shape

    def write_rest(
        self,
        moves: Sequence[Move],
        sources: Mapping[str, Any],
        dst_json: dict,
        *,
        zarr3: bool,
        ctx: Any,
        budget: int,
    ) -> None:
        """Writes this op's ``moves`` that are neither routed piece by piece nor made (a
        LoRA merge's, layer by layer) into the database ``dst_json``, within ``budget``;
        ``sources``: the source items' readers."""
        raise NotImplementedError(self.value)

    # -- a leaf exported layer by layer (`hf.export_stream`) -------------------------------
    def by_box(self, m: Move) -> bool:
        """Whether the leaf ``m`` writes can be exported box by box (`box`)."""
        return False

    def box(
        self, m: Move, i: int, start: tuple[int, ...], w: np.ndarray, factors: LayerReader
    ) -> np.ndarray | None:
        """The box at ``start`` of layer ``i`` of the leaf ``m`` writes, from the source's
        values there (``w``); None where it cannot be computed alone."""
        return None

    def layer(
        self, m: Move, axis: int | None, index: int | None, read: LayerReader, cache: dict
    ) -> np.ndarray:
        """Layer ``index`` on ``axis`` of the leaf ``m`` writes (all of it with None), from
        stored layers ``read`` gives; ``cache`` keeps what a later layer reuses."""
        raise LayoutMismatchError(f"{keystr(m.dst)}: cannot export a {self.value} move.")

    def piece_overhead(self, m: Move) -> float:
        """What a piece's export job holds beyond the piece and the hooks, in pieces."""
        return 0


@dataclasses.dataclass(frozen=True)
class LoraFactor:
    """The LoRA factors of a weight, read from ``item``: ``a`` (in, r) and ``b`` (r, out).

    Scanned factors stack their layers on ``axis`` (the weight's layer axis);
    ``scale`` is alpha / rank; ``layout`` places ``a @ b`` on the weight
    (`lora.delta_layouts`: ``()`` a reshape, else the permutation of an einsum weight's dims).
    """

    item: str
    a: Path
    b: Path
    a_spec: LeafSpec
    b_spec: LeafSpec
    axis: int | None
    scale: float
    layout: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class NoArgs:
    """The parameters of an op that takes none (a copy)."""


Op.Args = NoArgs


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One destination leaf ``dst`` (a full items path) and how it is made: by ``op``, with
    its own parameters ``args`` (an ``op.Args``; a copy's, `NoArgs`, by default).

    ``item``/``src`` name the source leaf (for ``stack``: the first present layer,
    all layers in its ``layers``); ``spec`` is the stored form of that source leaf (for
    ``constant``/``fresh``: of the leaf written). `out_spec` is what is written.
    """

    item: str
    src: Path
    dst: Path
    dest: Dest
    spec: LeafSpec
    note: str = ""  # e.g. "synthesized from ..." for a leaf copied to a second place
    op: Op = None  # type: ignore[assignment]  # a copy, see __post_init__
    args: Any = None  # the op's parameters (``op.Args``); None: an op that takes none

    def __post_init__(self) -> None:
        op = self.op or Op.COPY
        object.__setattr__(self, "op", op)
        if self.args is None:
            object.__setattr__(self, "args", op.Args())
        elif not isinstance(self.args, op.Args):
            raise TypeError(f"{op.value} takes {op.Args.__name__}, not {self.args!r}")

    @property
    def sources(self) -> tuple[Path, ...]:
        """The source leaves read (all in ``item``)."""
        return self.op.sources(self)

    @property
    def reads(self) -> tuple[tuple[str, Path, LeafSpec], ...]:
        """Every source leaf read, as ``(item, path, stored spec)``: `sources` in
        ``item``, plus a merge's LoRA factors (in their own item)."""
        return self.op.reads(self)

    # The op's parameters as the move's fields once spelled them (read only, for the public
    # surface; the package asks ``args``, or the op).
    @property
    def cast(self) -> np.dtype | None:
        """cast: the stored dtype cast to."""
        return getattr(self.args, "dtype", None)

    @property
    def axis(self) -> int | None:
        """slice, stack, fresh, merge_lora: the layer axis of the stacked side."""
        return getattr(self.args, "axis", None)

    @property
    def index(self) -> int | None:
        """slice (and an unrolled merge_lora): the layer taken."""
        return getattr(self.args, "index", None)

    @property
    def layers(self) -> tuple[Path | None, ...]:
        """stack (and a stacked merge_lora): the source path of each layer."""
        return getattr(self.args, "layers", ())

    @property
    def value(self) -> int | None:
        """constant: the value written."""
        return getattr(self.args, "value", None)

    @property
    def lora(self) -> tuple[LoraFactor, ...]:
        """merge_lora: the factors, one per layer (or one for all)."""
        return self.op.factors(self)

    @property
    def layer_count(self) -> int | None:
        """How many layers the written leaf stacks on ``axis`` (None: one layer)."""
        if self.layers:
            return len(self.layers)
        if self.axis is None or self.index is not None:
            return None
        return self.spec.shape[self.axis]

    @property
    def out_spec(self) -> LeafSpec:
        """The stored form of the leaf written."""
        return self.op.out_spec(self)

    def describe(self) -> str:
        """One line for reports: ``dst <- op(sources)``."""
        src = ", ".join(f"{self.item}/{keystr(p)}" for p in self.sources[:2])
        more = f", ... ({len(self.sources)} scan steps)" if len(self.sources) > 2 else ""
        return f"{keystr(self.dst)} <- {self.op.value}({src}{more}){self.op.detail(self)}"


@dataclasses.dataclass(frozen=True, slots=True)
class Drop:
    item: str
    src: Path
    spec: LeafSpec
    reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every destination leaf (`moves`) and every source leaf left behind (`drops`).

    ``rules`` are the tree rules applied, ``step``/``step_source`` where ``step``
    comes from, ``scan`` the scan change (``"unroll"``/``"stack"``) if any, with
    ``scan_axes`` (stacked model path -> layer axis of the Params, what a replay needs).
    """

    moves: tuple[Move, ...]
    drops: tuple[Drop, ...]
    rules: tuple[str, ...]
    step: int | None
    step_source: str
    notes: tuple[str, ...] = ()
    scan: str | None = None
    scan_axes: tuple[tuple[str, int], ...] = ()

    def summary(self) -> dict[str, dict[str, int]]:
        """Leaves and bytes written per destination (and dropped): the core of every report."""
        out = {d.value: {"leaves": 0, "bytes": 0} for d in Dest}
        for m in self.moves:
            out[m.dest.value]["leaves"] += 1
            out[m.dest.value]["bytes"] += m.out_spec.nbytes
        for d in self.drops:
            out[Dest.DROPPED.value]["leaves"] += 1
            out[Dest.DROPPED.value]["bytes"] += d.spec.nbytes
        return out

    def moves_from(self, item: str) -> list[Move]:
        return [m for m in self.moves if any(i == item for i, _, _ in m.reads)]

    def source_bytes(self) -> int:
        """Bytes of source leaves the plan reads (the progress total of a conversion)."""
        seen = {(i, p): s.nbytes for m in self.moves for i, p, s in m.reads}
        return sum(seen.values())


Reader = Callable[[str, Path], np.ndarray]
"""``read(item, path)``: a source leaf, whole, in stored form."""
LayerReader = Callable[[str, Path, "int | None", "int | None"], np.ndarray]
"""``read_layer(item, path, axis, index)``: layer ``index`` of a stored array on ``axis``
(the whole array when ``axis`` or ``index`` is None)."""
