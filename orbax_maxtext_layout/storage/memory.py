"""What an operation may hold and how many threads run it: the one default memory budget,
the one count of the cores and the worker policies built on it, and the one gate every
streaming operation keeps its bytes in flight behind (the converter's LoRA merge, the
restore engine's host buffers, the Hugging Face import and export).

Nothing here knows what it holds: a claim is a number of bytes.
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

# What a conversion, a merge, an export or an import holds at once unless told otherwise
# (``memory_budget``, ``--memory-budget``). The restore engine sizes its own from the host
# (`execute.restore_engine.BUDGET_SHARE`): a trainer's restore is not given one.
DEFAULT_BUDGET = 1 << 30  # 1 GiB


# -- workers -------------------------------------------------------------------------------
def cores() -> int:
    """The cores this process may run on (its CPU affinity, as ``taskset`` or a container's
    cpuset leaves it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - a platform without affinity (macOS)
        return os.cpu_count() or 1


class Workers(NamedTuple):
    """How many threads an operation runs: ``per_core`` a core (`cores`), at least 1 and at
    most ``most``; or ``fixed`` whatever the cores (a count recorded with the output, or
    measured on this project's 2-core VM as the best there)."""

    per_core: int = 1
    most: int | None = None
    fixed: int | None = None

    def count(self) -> int:
        if self.fixed is not None:
            return self.fixed
        n = self.per_core * cores()
        return max(1, n if self.most is None else min(self.most, n))


# The policies, one per measured reason (each measurement is in the module that runs it):
# the restore engine decodes one stored chunk a core, without the GIL.
RESTORE = Workers()
# import-hf: two a core, at most 8, as a worker waits on its blocks' writes for much of a
# slice (`hf.import_hf`: 1.95x the read-and-encode floor against 2.09x with one a core).
IMPORT = Workers(per_core=2, most=8)
# merge-lora's layers: one a core, at most 2 (numpy's merge and zstd's encode run without
# the GIL; `lora.merge_writer`).
MERGE = Workers(most=2)
# copies of data files: one a core, at most 4 (the copy runs in the kernel;
# `storage.placement`).
COPY = Workers(most=4)
# convert's source arrays walked at once: one more than the 2 cores measured on, as a
# worker waits on its piece's commit (`execute.source_walk`); fixed, since the piece size it
# sets is recorded with the output (``piece_bytes``).
CONVERT = Workers(fixed=3)
# export-hf's params in flight: two (`hf.budget`), the pieces sized from it.
EXPORT = Workers(fixed=2)


# -- the gate ------------------------------------------------------------------------------
class Stopped(Exception):
    """A wait at a `Gate` ended because its owner stopped it (the operation failed, or is
    over)."""


class Gate:
    """Bytes in flight, at most ``limit``.

    `take` waits until a claim fits (with ``spare`` more to spare), or until nothing at all
    is held: a claim larger than the whole limit still passes, alone. With ``lane``, it
    also passes once nothing is active in that lane (`count`): the holders that would give
    bytes back without this claim; waiting on others (a decode that holds its kernel until
    its layers run) would wait forever. ``cap``: a claim larger than the limit holds the
    limit (what `take` returns is what to `give` back). `stop` wakes every waiter, whose
    wait then raises `Stopped`.
    """

    def __init__(self, limit: int, *, cap: bool = False) -> None:
        self.limit, self.cap, self.used, self.stopped = limit, cap, 0, False
        self.active: dict[str, int] = {}
        self._cv = threading.Condition()

    def take(self, n: int, *, spare: int = 0, lane: str | None = None) -> int:
        """Holds ``n`` bytes (the limit, where capped and ``n`` is larger) once they may be
        held; returns what is held."""
        if self.cap:
            n = min(n, self.limit)
        with self._cv:
            self._cv.wait_for(lambda: self.stopped or self._admits(n, spare, lane))
            if self.stopped:
                raise Stopped("the operation stopped")
            self.used += n
        return n

    def _admits(self, n: int, spare: int, lane: str | None) -> bool:
        if self.used == 0 or self.used + n + spare <= self.limit:
            return True
        return lane is not None and not self.active.get(lane, 0)

    def give(self, n: int) -> None:
        """Gives ``n`` held bytes back, waking whoever waits."""
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def count(self, lane: str, k: int) -> None:
        """``k`` more holders active in ``lane`` (fewer, where negative)."""
        with self._cv:
            self.active[lane] = self.active.get(lane, 0) + k
            self._cv.notify_all()

    def stop(self) -> None:
        """Wakes whoever waits: their wait raises `Stopped`; so does every later `take`."""
        with self._cv:
            self.stopped = True
            self._cv.notify_all()
