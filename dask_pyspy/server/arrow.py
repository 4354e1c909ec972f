"""arrow's memory pool, noted once a second while memory per task is tracked: pyarrow
allocates through a pool of its own, which neither Python's allocators nor numpy's
handler see, and only Python can ask for its total (see `rust/heap/arrow.rs`)."""

from __future__ import annotations

import sys

from tornado.ioloop import PeriodicCallback

from dask_pyspy.sampler import Sampler

EVERY_MS = 1000  # the series keeps one value a second


class ArrowPool:
    """A server's part: on its event loop, arrow's total noted into the sampler's series."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.callback = PeriodicCallback(self.note, EVERY_MS)
        self.callback.start()

    def note(self) -> None:
        # Never imported here: a process that has not imported pyarrow has no pool.
        pyarrow = sys.modules.get("pyarrow")
        if pyarrow is not None and self.sampler.options.memory:
            self.sampler.note_arrow_bytes(pyarrow.total_allocated_bytes())

    def remove(self) -> None:
        self.callback.stop()
