"""The restore engine: arrays of an Orbax item read straight into their shardings, every
stored chunk decoded once, in parallel, across all chunks of all arrays.

Stock Orbax reads each target shard through tensorstore, which decodes a stored chunk's
zstd frame on one thread and into fresh memory (the kernel zeroes each page on first
touch). Here each array's target shards become *boxes* (one per distinct index: replicas
share one), each box needs the stored chunks it overlaps, and one task per stored chunk
(`chunks.decode_cell`) decodes it once and copies what it holds into every box that needs
it, cast to the box's dtype as Orbax casts (tensorstore's ``cast`` driver: `orbax_io.casts`).
A chunk that is exactly one box, in the box's dtype, is decoded straight into the box
(`chunks.decode_cell_into`). A pool sized to the cores runs the tasks, the largest first.
A box is placed on its devices (`jax.device_put`, one copy per device as Orbax makes them)
by the task that completes it, so transfers overlap decoding; its host buffer then goes
back to a pool of buffers, reused by later boxes within ``budget`` bytes: the whole model
is never held twice on the host.
Host arrays (a request without a sharding) are decoded into their own fresh buffers, which
are the result.

On an object store (``gs://``) each request waits a round trip before its first byte, so the
stored chunks are fetched ahead of their decoders (`_Ahead`, `ItemReader.fetch`): straight
from their data files, where the item's B-tree (walked once when the item is opened) places
them, as ranged reads all in flight at once (neighbours in one data file joined, up to a
share of the batch), within `FETCH_AHEAD` bytes beyond those being decoded; a free worker
takes a task whose chunk has arrived first. The metadata is read once per restore
(`orbax_files.reads_only`). Object stores take the engine whatever the chunking, by
measurement (bench/gcs_restore.py against the GCS emulator, docs/object-stores.md): with
20 or 50 ms before each response, as at a real bucket, it took 0.79-1.07x stock's time on
1 and 8 chunks per array, where handing the arrays to tensorstore took 1.46-1.95x (the
stock path then also pays stock Orbax's own ~35 metadata requests, one after another);
only with no added latency on a 2-core VM, CPU-bound, is tensorstore's C++ faster
(1.1-1.3x), a case no real bucket has.

What it does not take (`why_not`) goes the stock way, by the caller: a
codec other than plain zstd, a shape other than the stored one (Orbax pads or truncates),
scalars (Orbax's scalar value type: stock returns a Python or NumPy scalar; 0-d arrays are
read here), empty arrays, PRNG key dtypes, a sharding without a per-device index, another
memory kind.
``OMTL_RESTORE_ENGINE=stock`` sends everything the stock way.

Imports: `orbax_io`, `storage`, `errors`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np

from ..errors import CheckpointReadError, detached
from ..orbax_io import casts, chunks
from ..orbax_io.reader import ItemReader
from ..orbax_io.stored_values import PIECE
from ..orbax_io.zarr import ChunkLayout, np_dtype
from ..storage.memory import RESTORE, Gate
from ..storage.scratch import Ahead, aligned

logger = logging.getLogger(__name__)

ENV = "OMTL_RESTORE_ENGINE"  # "stock": every array the stock way
# Host staging buffers of boxes on their way to an accelerator, at most: an eighth of the
# host's memory (5 GiB on a 40 GiB TPU v5e host), so that the largest arrays of a step
# saved one chunk per array (an 8B MLP kernel: 1.8 GiB) decode side by side.
BUDGET_SHARE = 8
_STREAM_PIECE = 4 * PIECE  # a chunk that is not one box is streamed in pieces this large
_POPULATE_FROM = 64 << 20  # boxes at least this large are faulted in ahead of their decoder
_POPULATE_STEP = 16 << 20  # ... in ranges this large, in order
# On an object store the stored chunks are fetched ahead of their decoders
# (`ItemReader.fetch`), at most this many stored bytes beyond those being decoded.
FETCH_AHEAD = 1 << 30
_PICK_AMONG = 256  # the pending tasks looked at for one whose chunk has arrived
TASKS = "tasks"  # the host buffers' gate lane: the tasks running


@dataclasses.dataclass(frozen=True)
class ArrayRequest:
    """One array to restore: item array ``name`` (Orbax's dotted name) as ``shape`` and
    ``dtype``, placed with ``sharding`` (None: a host ``np.ndarray``)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("stock", "0", "off")


def why_not(reader: ItemReader, req: ArrayRequest) -> str | None:
    """Why the engine leaves ``req`` to stock Orbax, or None when it reads it."""
    if not enabled():
        return f"{ENV}=stock"
    lay = reader.layout(req.name)
    if lay is None:
        return "no zarr metadata"
    if not lay.plain:
        return "a codec other than plain zstd"
    if tuple(req.shape) != lay.shape:
        return "a shape other than the stored one"
    if 0 in lay.shape:
        return "an empty array"
    if (reader.files.value_meta.get(req.name) or {}).get("value_type") == "scalar":
        return "a scalar"  # stock gives a Python or NumPy scalar, not an array
    if _is_key(req.dtype):
        return "a PRNG key"
    if np_dtype(np.dtype(req.dtype).name) is None:
        return f"dtype {req.dtype}"
    if not casts.castable(lay.dtype, np.dtype(req.dtype)):
        return f"a cast from {lay.dtype} to {np.dtype(req.dtype)}"  # stock raises its error
    if req.sharding is not None:
        if getattr(req.sharding, "memory_kind", None) not in (None, "device"):
            return f"memory kind {req.sharding.memory_kind}"
        try:
            req.sharding.addressable_devices_indices_map(lay.shape)
        except Exception:  # any sharding jax cannot index goes stock
            return "a sharding without per-device indices"
    return None


def _is_key(dtype: Any) -> bool:
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


# -- the work: boxes and chunk tasks -------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Box:
    """One distinct index of an array's target shards, and the devices that hold it.

    A box never refers to its `_Array` (which lists its boxes): a cycle between the two
    kept every placed shard, the item's reader and its mappings alive after the caller's
    ``del``, until a full collection (issue 57). It holds what it needs of the array: the
    dtype, and the array's list of placed single-device arrays.
    """

    dtype: np.dtype
    placed: list  # the array's single-device jax arrays (`_Array.placed`, shared)
    start: tuple[int, ...]
    stop: tuple[int, ...]
    devices: list  # jax devices; [None] for a host array
    waiting: int = 0  # stored chunks not yet copied in
    buf: np.ndarray | None = None
    pooled: bool = False
    ahead: Ahead | None = None  # a large buffer being faulted in ahead of its writers

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(eq=False)
class _Array:
    key: Hashable
    reader: ItemReader
    req: ArrayRequest
    lay: ChunkLayout
    boxes: list[_Box] = dataclasses.field(default_factory=list)
    placed: list = dataclasses.field(default_factory=list)  # single-device jax arrays

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.req.dtype)


def _boxes(arr: _Array) -> list[_Box]:
    shape, sharding = arr.lay.shape, arr.req.sharding
    if sharding is None:
        return [_Box(arr.dtype, arr.placed, (0,) * len(shape), shape, [None])]
    by_index: dict[tuple, _Box] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))
        stop = tuple(s.indices(n)[1] for s, n in zip(index, shape, strict=True))
        box = by_index.get((start, stop))
        if box is None:
            box = by_index[start, stop] = _Box(arr.dtype, arr.placed, start, stop, [])
        box.devices.append(device)
    return list(by_index.values())


@dataclasses.dataclass(eq=False)
class _ChunkTask:
    """One stored chunk of an array, and the boxes it fills."""

    array: _Array
    cell: tuple[int, ...]
    boxes: list[_Box]


def _tasks(arrays: list[_Array]) -> list[_ChunkTask]:
    out = []
    for arr in arrays:
        by_cell: dict[tuple, _ChunkTask] = {}
        for box in arr.boxes:
            for cell in chunks.cells(arr.lay, box.start, box.stop):
                by_cell.setdefault(cell, _ChunkTask(arr, cell, [])).boxes.append(box)
                box.waiting += 1
        out.extend(by_cell.values())
    # Array by array, the largest first (fewest idle cores at the end), each array's chunks
    # in storage order: a box completes, and its host buffer is reused, as early as it can.
    order = {id(a): i for i, a in enumerate(sorted(arrays, key=lambda a: -a.lay.nbytes))}
    out.sort(key=lambda t: (order[id(t.array)], t.cell))
    return out


# -- host buffers ------------------------------------------------------------------------------
class _Buffers:
    """Reused host buffers of boxes on their way to devices, at most ``budget`` bytes in use
    while any task runs (one box larger than the budget is made alone): a `Gate` whose lane
    `TASKS` counts the tasks running (`started`), since only a running task gives a buffer
    back (a box is given back by the task that completes it)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.free = budget, []
        self.gate = Gate(budget)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        self.gate.take(nbytes, lane=TASKS)
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits (by index: arrays do not compare as values)
                return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
        return aligned(nbytes)

    def give(self, buf: np.ndarray, nbytes: int) -> None:
        # The buffer is free before its bytes are: a take the give lets through finds it.
        with self.lock:
            self.free.append(buf)
            # Never keep more than the budget of idle buffers: drop the smallest.
            while sum(b.nbytes for b in self.free) > self.budget and len(self.free) > 1:
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].nbytes))
        self.gate.give(nbytes)

    def started(self, n: int) -> None:
        self.gate.count(TASKS, n)


def _aliases(device: Any) -> bool:
    """Whether ``jax.device_put`` of an aligned host buffer onto ``device`` may keep using
    that buffer instead of copying it: JAX's CPU client does (even with
    ``may_alias=False``, JAX 0.10), so a CPU box's buffer must never be reused."""
    return getattr(device, "platform", "cpu") == "cpu"


def _own(x: np.ndarray) -> np.ndarray:
    out = aligned(x.nbytes).view(x.dtype).reshape(x.shape)
    np.copyto(out, x)
    return out


def _view(buf: np.ndarray, box: _Box) -> np.ndarray:
    return buf[: box.nbytes].view(box.dtype).reshape(box.shape)


# -- the engine --------------------------------------------------------------------------------
def read_arrays(
    reader: ItemReader,
    requests: Mapping[Hashable, ArrayRequest],
    *,
    workers: int | None = None,
    budget: int | None = None,
) -> dict[Hashable, Any]:
    """Reads every request (each one `why_not` accepts) of the item ``reader`` opened:
    ``{key: jax.Array}`` with the request's sharding, or ``{key: np.ndarray}`` without one.

    Raises `CheckpointReadError` naming the array for a chunk that is missing, truncated or
    corrupt; then nothing is returned (what was placed is dropped).
    """
    return read_across(
        {k: (reader, r) for k, r in requests.items()}, workers=workers, budget=budget
    )


def read_across(
    reads: Mapping[Hashable, tuple[ItemReader, ArrayRequest]],
    *,
    workers: int | None = None,
    budget: int | None = None,
) -> dict[Hashable, Any]:
    """`read_arrays` over arrays of several items (``{key: (reader, request)}``), in one
    pool: a Tunix step's ``model_params`` and ``optimizer_state`` decode side by side,
    with no idle cores at the end of the first item's arrays."""
    outcome = _read_all(reads, workers, budget)
    if isinstance(outcome, BaseException):
        try:
            raise outcome
        finally:  # this frame, in the error's traceback, must not hold the error itself
            outcome = None
    return outcome


def _read_all(
    reads: Mapping[Hashable, tuple[ItemReader, ArrayRequest]],
    workers: int | None,
    budget: int | None,
) -> dict[Hashable, Any] | BaseException:
    """The arrays read, or the error a task met, returned rather than raised: nothing of
    the run (placed shards, staging buffers) outlives this call on the error path."""
    arrays = []
    for key, (reader, req) in reads.items():
        arr = _Array(key, reader, req, reader.layout(req.name))
        arr.boxes = _boxes(arr)
        arrays.append(arr)
    tasks = _tasks(arrays)
    if not tasks:
        return {}
    workers = workers or RESTORE.count()
    budget = chunks.host_memory() // BUDGET_SHARE if budget is None else budget
    run = _ReadCall(_Buffers(budget))
    workers = max(1, min(workers, len(tasks)))
    # At most one task per worker is handed out: a box's buffer is taken only when its first
    # chunk is about to be decoded, so the buffers in use are what keeps the cores busy (a
    # step of many chunks per array fills an array or two at a time and reuses their
    # buffers; one chunk per array fills as many arrays side by side as there are cores).
    slots = threading.BoundedSemaphore(workers)
    ahead = _Ahead(tasks, min(budget, FETCH_AHEAD))
    # A few more threads fault large fresh buffers in ahead of their decoders (`Ahead`):
    # a page is zeroed by the kernel on first touch (0.9 GB/s on one core of a TPU host),
    # as costly as the decode itself when one large chunk is one box.
    run.populating = cf.ThreadPoolExecutor(max(1, workers // 4), "omtl-populate")
    with run.populating, cf.ThreadPoolExecutor(workers, "omtl-restore") as pool:
        futures = []
        pending = list(range(len(tasks)))
        while pending:
            ahead.fetch_from(pending[0])
            slots.acquire()
            task = tasks[pending.pop(ahead.pick(pending))]
            if run.failed.is_set():
                slots.release()
                break
            for box in task.boxes:
                run.allocate(box)
            run.buffers.started(1)
            future = pool.submit(run.task, task)
            future.add_done_callback(lambda _: slots.release())
            futures.append(future)
        for f in futures:
            f.result()
        run.populating.shutdown(cancel_futures=True)
    run.populating = None
    if run.error is not None:
        _discard(arrays)
        error, run.error = run.error, None
        return detached(error, where="in a restore worker")
    return {arr.key: run.result(arr) for arr in arrays}


class _Ahead:
    """The stored chunks of an object store's tasks, fetched ahead of their decoders: before
    task ``i`` is handed out, every chunk of tasks ``i`` onwards within ``window`` stored
    bytes is in flight (`ItemReader.fetch`: one batch of ranged reads, neighbours joined).
    Tasks on a local disk read their own data files (nothing to fetch)."""

    def __init__(self, tasks: list[_ChunkTask], window: int) -> None:
        self.tasks, self.window, self.issued = tasks, window, 0
        self.sizes = [_stored_bytes(t) for t in tasks]

    def fetch_from(self, i: int) -> None:
        if self.issued > i + 1 and sum(self.sizes[i : self.issued]) > self.window // 2:
            return  # enough in flight; fetched in batches, so neighbours can be joined
        todo: dict[int, tuple[ItemReader, list[str]]] = {}
        held = sum(self.sizes[i : self.issued])
        while self.issued < len(self.tasks) and (held < self.window or self.issued <= i):
            task = self.tasks[self.issued]
            reader = task.array.reader
            if not reader.store.reads_files:
                keys = todo.setdefault(id(reader), (reader, []))[1]
                keys.append(chunks.stored_key(task.array.lay, task.array.req.name, task.cell))
            held += self.sizes[self.issued]
            self.issued += 1
        for reader, keys in todo.values():
            reader.fetch(keys)

    def pick(self, pending: list[int]) -> int:
        """Which of the ``pending`` tasks (indices, in order) to hand out next: the first
        whose fetched chunk has arrived (reads complete out of order; a worker waiting on
        one read while others sit ready would leave the decode to the end), else the first."""
        for j, i in enumerate(pending[:_PICK_AMONG]):
            if i >= self.issued:
                break
            task = self.tasks[i]
            reader = task.array.reader
            if reader.store.reads_files:
                return 0  # a local disk: storage order
            if reader.fetched_ready(
                chunks.stored_key(task.array.lay, task.array.req.name, task.cell)
            ):
                return j
        return 0


def _stored_bytes(task: _ChunkTask) -> int:
    """The stored bytes of a task's chunk on an object store (0 on a local disk)."""
    reader = task.array.reader
    if reader.store.reads_files:
        return 0
    return reader.stored_length(chunks.stored_key(task.array.lay, task.array.req.name, task.cell))


def _discard(arrays: list[_Array]) -> None:
    """A failed run's placed shards freed on their devices now, its buffers dropped."""
    for arr in arrays:
        for x in arr.placed:
            x.delete()
        arr.placed.clear()
        for box in arr.boxes:
            box.buf = box.ahead = None


class _ReadCall:
    """One `read_arrays` call: its tasks' shared state."""

    def __init__(self, buffers: _Buffers) -> None:
        self.buffers = buffers
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self.populating: cf.ThreadPoolExecutor | None = None

    def allocate(self, box: _Box) -> None:
        if box.buf is not None:
            return
        if box.devices == [None] or _aliases(box.devices[0]):
            # A host array's buffer is the result; a CPU device keeps the buffer it is
            # given (`_aliases`): either way it is never reused.
            box.buf = aligned(box.nbytes)
        else:
            box.buf, box.pooled = self.buffers.take(box.nbytes), True
        if box.nbytes >= _POPULATE_FROM and self.populating is not None:
            box.ahead = Ahead(box.buf[: box.nbytes], _POPULATE_STEP)
            for i in range(len(box.ahead.state)):
                self.populating.submit(box.ahead.touch, i)

    def task(self, task: _ChunkTask) -> None:
        try:
            if not self.failed.is_set():
                self._fill(task)
        except BaseException as e:  # reported once, by read_arrays
            with self.lock:
                if self.error is None:
                    self.error = _named(e, task.array.reader, task.array.req.name)
            self.failed.set()
        finally:
            self.buffers.started(-1)

    def _fill(self, task: _ChunkTask) -> None:
        arr = task.array
        region = _direct(task)
        if region is not None:  # the chunk is one contiguous run of its box: decoded there
            box = task.boxes[0]
            before = None
            if box.ahead is not None:
                offset = region.ctypes.data - box.buf.ctypes.data

                def before(a: int, b: int, _o: int = offset, _ahead: Ahead = box.ahead) -> None:
                    _ahead.claim(_o + a, _o + b)

            chunks.decode_cell_into(arr.reader, arr.req.name, task.cell, region, before=before)
        else:
            for piece in chunks.decode_cell(
                arr.reader, arr.req.name, task.cell, max_bytes=_STREAM_PIECE
            ):
                for b in task.boxes:
                    _copy(piece, b)
        for b in task.boxes:
            with self.lock:
                b.waiting -= 1
                done = b.waiting == 0
            if done:
                self._place(b)

    def _place(self, box: _Box) -> None:
        """A completed box onto its devices (a host array's box is its result already)."""
        if box.devices == [None]:
            return
        view = _view(box.buf, box)
        if box.pooled:
            placed = [jax.device_put(view, d) for d in box.devices]
            for x in placed:  # the host buffer is reused once every copy has left it
                x.block_until_ready()
            self.buffers.give(box.buf, box.nbytes)
        else:  # each CPU device holds a buffer of its own (donation writes into it)
            placed = [jax.device_put(view, box.devices[0])]
            placed += [jax.device_put(_own(view), d) for d in box.devices[1:]]
        box.buf = None
        with self.lock:
            box.placed.extend(placed)

    def result(self, arr: _Array) -> Any:
        if arr.req.sharding is None:
            return _view(arr.boxes[0].buf, arr.boxes[0])
        return jax.make_array_from_single_device_arrays(arr.lay.shape, arr.req.sharding, arr.placed)


def _copy(piece: chunks.Piece, box: _Box) -> None:
    """What of ``piece`` lies in ``box``, copied in (cast to the box's dtype)."""
    lo = [max(a, s) for a, s in zip(box.start, piece.start, strict=True)]
    hi = [min(b, s + n) for b, s, n in zip(box.stop, piece.start, piece.data.shape, strict=True)]
    if any(h <= x for x, h in zip(lo, hi, strict=True)):
        return
    src = tuple(slice(x - s, h - s) for x, h, s in zip(lo, hi, piece.start, strict=True))
    dst = tuple(slice(x - s, h - s) for x, h, s in zip(lo, hi, box.start, strict=True))
    into = _view(box.buf, box)[(*dst, ...)]  # `...`: a 0-d box's view, not a copy of its value
    if box.ahead is not None:
        first, last = _byte_bounds(into)
        base = box.buf.ctypes.data
        box.ahead.claim(first - base, last - base)
    casts.cast_into(into, piece.data[src])  # as Orbax casts: tensorstore's cast driver


try:  # numpy 2
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - numpy 1
    _byte_bounds = np.byte_bounds


def _direct(task: _ChunkTask) -> np.ndarray | None:
    """Where in its box the task's chunk can be decoded straight into: the chunk's region of
    its one box when that region is one C-contiguous run (a chunk of whole trailing rows),
    the chunk lies wholly inside the array (an edge chunk is stored past the array's end)
    and the box keeps the stored dtype; else None (decoded in pieces and copied)."""
    arr, lay = task.array, task.array.lay
    if len(task.boxes) != 1 or arr.dtype != lay.dtype:
        return None
    box = task.boxes[0]
    origin = chunks.cell_origin(lay, task.cell)
    stop = tuple(o + c for o, c in zip(origin, lay.chunk, strict=True))
    if any(o < a or e > b for o, e, a, b in zip(origin, stop, box.start, box.stop, strict=True)):
        return None
    region = _view(box.buf, box)[  # `...`: a 0-d box's view, not a copy of its value
        (*(slice(o - a, e - a) for o, e, a in zip(origin, stop, box.start, strict=True)), ...)
    ]
    return region if region.flags.c_contiguous else None


def _named(e: BaseException, reader: ItemReader, name: str) -> BaseException:
    if isinstance(e, CheckpointReadError):
        return e
    if isinstance(e, Exception):
        return reader.read_error(name, e)
    return e
