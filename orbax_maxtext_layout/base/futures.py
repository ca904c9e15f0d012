"""The results of a pool's futures, and their first error raised with nothing of the pool
behind it.

A future that failed holds its exception, whose traceback holds the worker's frames (and
through them the work item, the future again, and whatever the worker was writing). The
caller that re-raises it from a frame that still holds the futures makes a reference cycle
through its own frame: everything its locals hold (readers and their mappings, buffers)
stays alive until a full collection (issue 57). `results` waits for every future, lets
the futures go, and raises the first error with its workers' frames dropped (kept as a note).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from ..errors import detached


def results(futures: Iterable[Future], *, where: str = "in a worker") -> list[Any]:
    """Each future's result, in order, once all are done; or the first error (in order),
    raised after every future finished and none is held here."""
    pending = list(futures)
    error = None
    for f in pending:
        if f.exception() is not None and error is None:
            error = f.exception()
    if error is None:
        return [f.result() for f in pending]
    pending.clear()  # the futures (which hold the error) go
    f = None
    try:
        raise detached(error, where=where)
    finally:  # this frame, in the error's traceback, must not hold the error
        error = None
