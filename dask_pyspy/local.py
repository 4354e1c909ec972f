"""Profiling dask's local schedulers (threads, sync), in the style of `dask.diagnostics.Profiler`."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from dask.callbacks import Callback
from dask.core import istask
from dask.utils import key_split

from dask_pyspy import config
from dask_pyspy.model import Profile, RunLog, task_totals
from dask_pyspy.sampler import Sampler, process_sampler

try:
    from dask._task_spec import Task
except ImportError:  # dask 2024.8: tasks are (func, *args) tuples only
    Task = ()  # type: ignore[assignment,misc]  # isinstance(x, ()) is False


def _node(cls: type[Task], state: Any) -> Task:
    """A Task of class `cls` with `state` from `Task.__getstate__`: a shallow copy, made as pickle makes one."""
    node = cls.__new__(cls)
    node.__setstate__(state)
    return node


def _same(x: Any) -> Any:
    return x


class _Tagged:
    """The function of a `(func, *args)` task (dask < 2024.11), tagging the thread it runs in."""

    __slots__ = ("run", "key", "func")

    def __init__(self, run: Callable[..., Any], key: Any, func: Callable[..., Any]) -> None:
        self.run, self.key, self.func = run, key, func

    def __call__(self, *args: Any) -> Any:
        return self.run(self.key, self.func, *args)

    def __reduce__(self) -> Any:
        return _same, (self.func,)  # the processes scheduler ships the plain function


class PySpyProfiler(Callback):
    """Samples this process while dask computes and tags samples with task keys.

    >>> with PySpyProfiler() as prof:  # doctest: +SKIP
    ...     x.compute(scheduler="threads")
    >>> prof.profile.save("local.html")  # doctest: +SKIP

    A task is tagged in the thread that runs it, while it runs: each task the
    scheduler hands out is swapped, in the scheduler's own copy of the graph, for one
    that tags its thread around the call. On dask < 2024.11 (tuple tasks) that is the
    call of the task's function, after its arguments were computed. The profile's
    metadata `tasks` has each prefix's task count and wall seconds. The processes
    scheduler runs tasks in other processes, which this process's sampler does not see.
    """

    def __init__(self, **sampler_options: Any) -> None:
        super().__init__()
        self._options = Sampler(**sampler_options).options  # bad options fail here, before any compute
        self._sampler: Sampler | None = None
        self._result: Profile | None = None
        self._lock = threading.Lock()
        self._runs: RunLog[tuple[str, float]] = RunLog(config.get("task-history"))
        self._tagged_types: dict[type, type] = {}
        self.start: float | None = None
        self.stop: float | None = None

    def _start(self, dsk: Any) -> None:
        with self._lock:
            if self._sampler is None:
                self._sampler = process_sampler.acquire(self._options)
            if self.start is None:
                self.start = time.time()

    def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
        # `dsk` is get_async's own copy of the graph (dask >= 2024.8): the user's stays untouched.
        node = dsk[key]
        if isinstance(node, Task) and node.key == key:  # a nested container has no key
            dsk[key] = _node(self._tagged_type(type(node)), node.__getstate__())
        elif isinstance(node, tuple) and istask(node):
            dsk[key] = (_Tagged(self._run, key, node[0]),) + node[1:]

    def _tagged_type(self, cls: type) -> type:
        """`cls` with a call that tags its thread; pickles as a plain `cls`."""
        tagged = self._tagged_types.get(cls)
        if tagged is None:
            run = self._run

            def __call__(node: Any, values: Any = ()) -> Any:
                return run(node.key, cls.__call__, node, values)

            def __reduce__(node: Any) -> Any:
                return _node, (cls, node.__getstate__())

            namespace = {"__slots__": (), "__call__": __call__, "__reduce__": __reduce__}
            tagged = self._tagged_types[cls] = type(cls)(cls.__name__, (cls,), namespace)
        return tagged

    def _run(self, key: Any, func: Callable[..., Any], *args: Any) -> Any:
        sampler = self._sampler
        if sampler is None:  # closed while another thread still computes
            return func(*args)
        ident, prefix = threading.get_ident(), key_split(key)
        sampler.set_thread_tag(ident, str(key), prefix)
        began = time.perf_counter()
        try:
            return func(*args)
        finally:
            self._runs.append((prefix, time.perf_counter() - began))
            sampler.clear_thread_tag(ident)

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
        profile = sampler.profile(self.start, self.stop or time.time(), by="prefix")
        tasks = task_totals(self._runs.copy())
        return profile.with_metadata(tasks={profile.processes[0]["name"]: tasks})

    @property
    def profile(self) -> Profile:
        """The samples from the first compute's start to the last one's end, tagged with tasks."""
        sampler = self._sampler
        if sampler is not None:
            return self._collect(sampler)
        if self._result is None:
            raise RuntimeError("nothing was computed under this PySpyProfiler yet")
        return self._result
