"""Writes the merge_lora moves `source_walk` cannot take piece by piece (a box that does not split
onto the factors): each stored base kernel decoded once, its layers merged and encoded on
both cores, within a memory bound.

The work is a pipeline of three kinds of thread:

* one *decoder* decodes the base kernels in plan order, each whole where it fits the budget
  (`ItemReader.read_whole`: each stored chunk once), with its LoRA factors; it runs ahead of the
  merge as far as memory allows;
* `MERGE_WORKERS` *workers* merge one layer each (`delta.merge_layer`, in place in that
  layer's buffer) and encode and write it as one chunk (`item_writer.write_part`);
* the caller hands the layers of each decoded kernel to the workers.

Memory is a gate (`storage.memory.Gate`) bounded by the claim ``budget + 3 * the largest
layer slice``: a decode takes the kernel's bytes (and its pieces) before it starts, with room
for one layer in flight to spare; a layer in flight takes what its encoding holds, passing
alone when no other layer is in flight (lane `LAYERS`); and each layer's buffer is given
back once it is written. So a kernel's memory shrinks layer by layer while the next one is decoded, and the
next decode waits where it would not fit. A kernel larger than the budget is read one layer
at a time (tensorstore decodes the stored chunks holding that layer).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorstore as ts

from ..base.treepaths import Path
from ..errors import detached
from ..orbax_io import item_writer, orbax_files
from ..orbax_io.orbax_files import param_name
from ..orbax_io.reader import FAST_DECODING, TS_DECODING, ItemReader
from ..plan.moves import Move
from ..storage.memory import MERGE, Gate
from .delta import merge_base, merge_layer

# Layers merged and encoded at once: one per core (numpy's merge and zstd's encode both run
# without the GIL).
MERGE_WORKERS = MERGE.count()
# The gate's lane of layers in flight: a layer waits for one of them, never for a decode
# (which holds its kernel until its layers run).
LAYERS = "layers"
# What a layer in flight holds beside its own buffer, in layer slices, while tensorstore
# encodes and writes it (its write buffer, the encoded chunk: weights encode to about 0.8 of
# their bytes). Measured: at 3 the next kernel's decode waits longer (7.5 s against 6.4 s
# for the 1 GiB benchmark at 512 MiB) for no lower peak.
_ENCODING = 2


def write_merges(
    moves: Sequence[Move],
    sources: Mapping[str, ItemReader],
    dst_json: dict,
    *,
    zarr3: bool,
    ctx,
    budget: int,
) -> None:
    """Writes every merge_lora move in ``moves`` into the database ``dst_json``."""
    if not moves:
        return
    kernels = _kernels(moves, sources, dst_json, zarr3=zarr3, ctx=ctx, budget=budget)
    slice_bytes = max(_layer_bytes(m) for m in moves)
    ledger = Gate(budget + 3 * slice_bytes)
    keep = max(t.cost for k in kernels for t in k.tasks)  # room for one layer in flight
    decoder = ThreadPoolExecutor(1, "merge-decode")
    # BLAS's own threads spin against the workers (a fifth of the CPU time, measured): the
    # command line runs with one BLAS thread (`cli.common.owned_process`); a library call
    # leaves the process's BLAS as it found it (issue 57).
    pool = ThreadPoolExecutor(MERGE_WORKERS, "merge")
    try:
        decoded = [decoder.submit(k.decode, ledger, keep) for k in kernels]
        pending: list = []
        for k, job in zip(kernels, decoded, strict=True):
            job.result()
            for t in k.tasks:
                # Only this thread takes layers, so none passes between the take and the count.
                ledger.take(t.cost, lane=LAYERS)
                ledger.count(LAYERS, 1)
                pending = [f for f in pending if not _raised(f)]
                pending.append(pool.submit(k.run, t, ledger))
        for f in pending:
            f.result()
    except BaseException as e:
        # The futures hold the error: none may be left in this frame, which its traceback
        # holds (a reference cycle); nor the workers' frames behind it (`detached`).
        decoded = pending = job = f = None
        detached(e, where="in a merge worker")
        raise
    finally:  # on a failure, the decodes still queued or waiting for memory stop
        ledger.stop()
        decoder.shutdown(wait=True, cancel_futures=True)
        pool.shutdown(wait=True, cancel_futures=True)


def _raised(f) -> bool:
    """Whether ``f`` is done (raising its error, which stops the merge at once)."""
    if f.done():
        f.result()
        return True
    return False


@dataclasses.dataclass
class _LayerTask:
    """Layer ``i`` of ``move``: base layer ``index`` of its kernel, written to ``layer``
    (``(axis, i)``, or None: the whole array) of ``out``."""

    move: Move
    i: int
    index: int | None
    layer: tuple[int, int] | None
    out: ts.TensorStore
    cost: int = 0  # what it holds in flight, beside its kernel's layer buffer


@dataclasses.dataclass
class _Kernel:
    """One stored base kernel (``item``, ``src``), its LoRA factors, and the layers of the
    moves that read it (``tasks``). ``whole``: decoded once, whole; else each task reads its
    own base layer."""

    item: str
    src: Path
    axis: int | None
    nbytes: int
    whole: bool
    sources: Mapping[str, ItemReader]
    ctx: object
    tasks: list[_LayerTask] = dataclasses.field(default_factory=list)
    layers: list | None = None
    factors: dict = dataclasses.field(default_factory=dict)
    own: bool = False  # its layers are buffers of their own (freed one by one)
    factor_bytes: int = 0
    left: int = 0  # tasks not done
    uses: dict = dataclasses.field(default_factory=dict)  # layer index -> tasks still to read it
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def decode(self, ledger: Gate, keep: int) -> None:
        """Decodes the kernel (if whole) and its factors, once they fit beside ``keep``
        bytes to spare (room for a layer in flight, so decoding ahead never starves the
        layers before it), or nothing is held."""
        factors = {
            (f.item, p): s
            for t in self.tasks
            for f in t.move.args.lora
            for p, s in ((f.a, f.a_spec), (f.b, f.b_spec))
        }
        factor_bytes = self.factor_bytes = sum(s.nbytes for s in factors.values())
        self.left = len(self.tasks)
        cost = factor_bytes + (int(FAST_DECODING * self.nbytes) if self.whole else 0)
        ledger.take(cost, spare=keep)
        try:
            for item, p in factors:
                self.factors[item, p] = self.sources[item].read_whole(param_name(p))
            if self.whole:
                whole = self.sources[self.item].read_whole(param_name(self.src))
                if self.axis is None:
                    self.layers, self.own = [whole], True
                else:  # views of the whole kernel: each layer is copied out
                    a = self.axis
                    self.layers = [whole[(slice(None),) * a + (i,)] for i in range(whole.shape[a])]
                    self.own = False
                    for t in self.tasks:
                        t.cost += self.nbytes // len(self.layers)
        except BaseException:
            ledger.give(cost)
            raise
        ledger.give(cost - factor_bytes - (self.nbytes if self.whole else 0))

    def run(self, t: _LayerTask, ledger: Gate) -> None:
        """Merges ``t``'s layer and writes it; then gives back what it held."""
        freed = 0
        try:
            w = self._base(t)
            merged = merge_layer(t.move, t.i, self._reader(t.move, w), inplace=True)
            item_writer.write_part(t.out, merged, t.layer)
            del w, merged
            freed = self._done(t)
        finally:
            ledger.give(t.cost + freed)
            ledger.count(LAYERS, -1)

    def _base(self, t: _LayerTask) -> np.ndarray:
        """The task's base layer: the kernel's own buffer where no later task reads it (the
        merge overwrites it), else a copy; or read from the source."""
        if self.layers is None:
            return merge_base(t.move, t.i, self._read)
        index = 0 if t.index is None else t.index
        layer = self.layers[index]
        with self.lock:
            last = self.uses[index] == 1
        if self.own and last:
            return layer
        return np.array(layer, order="C")  # a view of the whole kernel, or read again later

    def _done(self, t: _LayerTask) -> int:
        """Drops what no task still needs after ``t``: its layer of the kernel after that
        layer's last reader (a kernel of views: the kernel after the last task), and the
        factors after the last task. Returns the bytes freed."""
        index = 0 if t.index is None else t.index
        freed = 0
        with self.lock:
            self.left -= 1
            if self.layers is not None:
                self.uses[index] -= 1
                if self.own and not self.uses[index]:
                    self.layers[index] = None
                    freed += self.nbytes // len(self.layers)
            if not self.left:
                if self.layers is not None and not self.own:
                    freed += self.nbytes
                freed += self.factor_bytes
                self.layers, self.factors = None, {}
        return freed

    def _reader(self, m: Move, w: np.ndarray):
        """What `merge_layer` reads: ``w`` for the base, the factors' layers from their
        decoded wholes."""
        base = {(m.item, m.src), *((m.item, p) for p in m.args.layers)}

        def read(item, path, axis, index):
            if (item, path) in base:
                return w
            whole = self.factors.get((item, path))
            if whole is None:
                return self._read(item, path, axis, index)
            return whole if axis is None or index is None else np.take(whole, index, axis)

        return read

    def _read(self, item: str, path: Path, axis, index) -> np.ndarray:
        layer = None if axis is None or index is None else (axis, index)
        return self.sources[item].read_array(path, layer)


def _kernels(
    moves: Sequence[Move],
    sources: Mapping[str, ItemReader],
    dst_json: dict,
    *,
    zarr3: bool,
    ctx,
    budget: int,
) -> list[_Kernel]:
    """The base kernels the moves read, in plan order, each with its tasks (the moves'
    layers); creates each move's destination array."""
    kernels: dict[tuple[str, Path], _Kernel] = {}
    for m in moves:
        out = m.out_spec
        dst = item_writer.create_array(
            dst_json, orbax_files.param_name(m.dst), out.shape, out.dtype, m.op.chunk_shape(m),
            use_zarr3=zarr3, context=ctx,
        )  # fmt: skip
        key, g = (m.item, m.src), m.args  # `merge_op.MergeArgs`
        k = kernels.get(key)
        if k is None:
            whole = not g.layers and m.spec.nbytes <= budget
            k = kernels[key] = _Kernel(m.item, m.src, g.axis, m.spec.nbytes, whole, sources, ctx)
        count = g.layer_count(m.spec)
        for i in range(count or 1):
            index = g.index if count is None else i
            layer = None if count is None else (g.axis, i)
            k.tasks.append(_LayerTask(m, i, index, layer, dst, _task_cost(m, k.whole)))
            if k.whole:
                j = 0 if index is None else index
                k.uses[j] = k.uses.get(j, 0) + 1
    return list(kernels.values())


def _task_cost(m: Move, whole: bool) -> int:
    """What one layer of ``m`` holds in flight beside its kernel: its encoding, plus, where
    it is read on its own, the layer and tensorstore's decode of its stored chunk."""
    layer = _layer_bytes(m)
    return (_ENCODING + (0 if whole else 1 + TS_DECODING)) * layer


def _layer_bytes(m: Move) -> int:
    """The bytes of one layer of a merge_lora move's base kernel."""
    a = m.args.axis
    return m.spec.nbytes // max(1, m.spec.shape[a] if a is not None else 1)
