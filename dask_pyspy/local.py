"""Profiling dask's local schedulers (threads, sync), in the style of `dask.diagnostics.Profiler`."""

from __future__ import annotations

import threading
import time
from typing import Any

from dask.callbacks import Callback
from dask.utils import key_split

from dask_pyspy import config
from dask_pyspy.profile import Profile
from dask_pyspy.sampler import Sampler, process_sampler


class PySpyProfiler(Callback):
    """Samples this process while dask computes and tags samples with task keys.

    >>> with PySpyProfiler() as prof:  # doctest: +SKIP
    ...     x.compute(scheduler="threads")
    >>> prof.profile.save("local.html")  # doctest: +SKIP

    The local schedulers say which thread ran a task only once it finished, so a
    task's samples are tagged from when it was handed to the pool to when it was
    reported done on that thread. The processes scheduler runs tasks in other
    processes, which this process's sampler does not see.
    """

    def __init__(self, **sampler_options: Any) -> None:
        super().__init__()
        self._options = config.sampler_options(**sampler_options)
        Sampler(**self._options)  # bad options fail here
        self._sampler: Sampler | None = None
        self._result: Profile | None = None
        self._lock = threading.Lock()
        self._submitted: dict[Any, float] = {}
        self._runs: list[tuple[int, float, float, str, str]] = []
        self.start: float | None = None
        self.stop: float | None = None

    def _start(self, dsk: Any) -> None:
        with self._lock:
            if self._sampler is None:
                self._sampler = process_sampler.acquire(self._options)
            if self.start is None:
                self.start = time.time()

    def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
        self._submitted[key] = time.time()

    def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        began = self._submitted.pop(key, None)
        # Thread ids for the threaded scheduler; the sync scheduler runs tasks right here.
        ident = worker_id if isinstance(worker_id, int) and worker_id > 1 << 16 else threading.get_ident()
        if began is not None:
            self._runs.append((ident, began, time.time(), str(key), key_split(key)))

    def _finish(self, dsk: Any, state: Any, errored: bool) -> None:
        self.stop = time.time()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self.close()

    def close(self) -> None:
        """Stop sampling (it stops by itself when the `with` block ends)."""
        with self._lock:
            if self._sampler is not None:
                self._result = self._collect(self._sampler)
                self._sampler = None
                process_sampler.release()

    def _collect(self, sampler: Sampler) -> Profile:
        raw = sampler.profile(self.start, self.stop or time.time(), by="prefix")
        return raw.with_task_runs(list(self._runs))

    @property
    def profile(self) -> Profile:
        """The samples from the first compute's start to the last one's end, tagged with tasks."""
        sampler = self._sampler
        if sampler is not None:
            return self._collect(sampler)
        if self._result is None:
            raise RuntimeError("nothing was computed under this PySpyProfiler yet")
        return self._result
