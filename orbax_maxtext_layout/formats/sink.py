"""The seam every written file format implements: `Sink`, its files (`Part`) and a file
being written (`PartWriter`).

An export knows every tensor's name, shape and dtype from metadata before it computes a
byte, so a format's output is written in three stages, each a method of its `Sink`:

1. laid out from metadata (`Sink.layout`): which tensor goes into which file, and where in
   it; a `Part` says so, and its `Part.signature` (the bytes that fix its layout) names it
   in an export's fingerprint;
2. each part opened (`Sink.open`), written by name (`PartWriter.write`: a whole tensor) or
   by box (`PartWriter.write_box`: a box of a tensor at its start), in any order, by any
   thread, then closed (`PartWriter.close`: every tensor written, the file on the disk) or
   abandoned (`PartWriter.abandon`: a failure; the caller drops the file);
3. once every part is in place, the index (the files that say which part holds which
   tensor: `Sink.index`) and the config published last (`Sink.finish`): an output on an
   object store counts once its config is there (`StepStore.publish_dir`'s ``last``).

Where the files go (a staging directory, a part file renamed into place, several
processes writing one file) is the caller's: a sink only lays out, writes and indexes.
A new format is one module implementing `Sink` (`safetensors_writer.SafetensorsSink`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
from etils import epath

from ..storage.store import StepStore


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of an output: its name, shape and dtype (what its file's header says)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Part:
    """One file of an output: its name and its tensors in file order. A format's part adds
    where each tensor lies (`safetensors_writer.Shard`)."""

    name: str
    tensors: tuple[Tensor, ...]

    @property
    def data_bytes(self) -> int:
        """The bytes of its tensors."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        """The file's size in bytes (its tensors, and whatever the format frames them with)."""
        return self.data_bytes

    @property
    def signature(self) -> bytes:
        """The bytes that fix the file's layout: two parts with the same signature are the
        same file for the same tensors (hashed into an export's fingerprint)."""
        raise NotImplementedError


class PartWriter(abc.ABC):
    """One part being written: each tensor at its place, from any thread."""

    @abc.abstractmethod
    def write(self, name: str, array: np.ndarray) -> None:
        """Tensor ``name``, whole."""

    @abc.abstractmethod
    def write_box(self, name: str, start: Sequence[int], data: np.ndarray) -> None:
        """The box of tensor ``name`` at ``start`` (``data.shape`` long). Boxes of a tensor do
        not overlap; it counts as written once they cover it."""

    @property
    @abc.abstractmethod
    def missing(self) -> list[str]:
        """The names of the tensors not written yet."""

    @abc.abstractmethod
    def close(self) -> None:
        """The file complete and on the disk (an error where a tensor was never written,
        unless several writers share it)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """The file let go of after a failure, as it is."""


class Sink(abc.ABC):
    """A written file format: the files of a set of tensors, laid out from their metadata,
    written part by part, and indexed last (module docstring)."""

    @abc.abstractmethod
    def layout(self, tensors: Iterable[Tensor]) -> list[Part]:
        """The files of ``tensors``, each tensor's place fixed, from metadata alone."""

    @abc.abstractmethod
    def open(self, part: Part, path: str, *, shared: bool = False) -> PartWriter:
        """``part`` opened for writing at ``path``. ``shared``: several processes write this
        file, each its own tensors (it is opened as found, and `PartWriter.close` checks
        none of them)."""

    @abc.abstractmethod
    def index(self, parts: Sequence[Part]) -> dict[str, str]:
        """The files that say which of ``parts`` holds which tensor: name -> text (none
        where there is nothing to say, a single file)."""

    def finish(
        self, store: StepStore, work: epath.Path, parts: Sequence[Part], config: tuple[str, str]
    ) -> None:
        """Once every part is in ``work``: the index (`index`), then ``config`` (its name and
        text) last, which the caller names as ``last`` when it publishes ``work``."""
        for name, text in self.index(parts).items():
            store.replace_file(work / name, text)
        store.replace_file(work / config[0], config[1])
