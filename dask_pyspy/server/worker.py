"""A worker's half: tag samples with the task each thread runs (and its dask span),
log task times, and answer the scheduler's `pyspy_*` RPCs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import Any, Callable

from dask.utils import key_split
from distributed import Worker
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import Serialize, to_serialize

from dask_pyspy import config
from dask_pyspy._loop import off_loop
from dask_pyspy.model import RunLog, task_totals
from dask_pyspy.options import SamplerOptions
from dask_pyspy.sampler import Sampler
from dask_pyspy.server.shared import PLUGIN_NAME, SamplerHold, install_handlers, remove_handlers

MAX_SPANS = 10_000  # span names a worker keeps for its profiles; the scheduler knows them all


class SpanNames:
    """Names of the dask spans a worker's tasks ran in, from the tasks' annotations.

    The scheduler names every span when it merges; these cover a span it forgot and a
    profile of this worker alone. The default span carries no annotation.
    """

    def __init__(self) -> None:
        self.spans: dict[str, dict[str, list[str]]] = {}

    def span_of(self, ts: Any) -> str | None:
        """The span id of a worker's task state, noting the span's names."""
        span_id = getattr(ts, "span_id", None)
        if span_id is None or span_id in self.spans:
            return span_id
        ann = (getattr(ts, "annotations", None) or {}).get("span") or {}
        ids, names = list(ann.get("ids") or ()), list(ann.get("name") or ())
        if ids and ids[-1] == span_id and len(ids) == len(names) and len(self.spans) < MAX_SPANS:
            self.spans[span_id] = {"names": names, "ids": ids}
        return span_id

    def with_nested(self, ids: list[str] | None) -> list[str] | None:
        """`ids` and the spans named here that are nested in one of them: the scheduler
        resolves a request from the spans it knows, and may have forgotten some."""
        if ids is None:
            return None
        wanted = set(ids)
        nested = (span_id for span_id, span in list(self.spans.items()) if wanted.intersection(span["ids"]))
        return sorted(wanted.union(nested))


def managed_by_prefix(worker: Worker) -> dict[str, float]:
    """Per task prefix, the bytes of results the worker holds in memory (distributed's
    "managed" memory: spilled results are on disk)."""
    in_memory = getattr(worker.data, "fast", worker.data)
    tasks = worker.state.tasks
    out: dict[str, float] = {}
    for key in list(in_memory):
        ts = tasks.get(key)
        if ts is not None:
            out[ts.prefix] = out.get(ts.prefix, 0.0) + (ts.nbytes or 0)
    return out


class TaskTagger(dict):
    """`Worker.active_threads` that also tells the sampler which task each thread runs,
    and in which dask span.

    distributed sets and deletes entries in the executing thread as a task starts and
    ends, so the sampler's tag is right at capture time (see `_run_task`).
    """

    def __init__(self, sampler: Sampler, worker: Worker, spans: SpanNames, entries: dict[int, Any]) -> None:
        super().__init__(entries)
        self._sampler = sampler
        self._worker_name = worker.address
        self._tasks = worker.state.tasks
        self._spans = spans
        self._named: set[int] = set()
        for ident, key in entries.items():
            self._tag(ident, key)

    def _tag(self, ident: int, key: Any) -> None:
        span = self._spans.span_of(self._tasks.get(key))
        self._sampler.set_thread_tag(ident, str(key), key_split(key), span)

    def __setitem__(self, ident: int, key: Any) -> None:
        super().__setitem__(ident, key)
        self._tag(ident, key)
        if ident not in self._named:
            self._named.add(ident)
            self._sampler.set_thread_name(ident, f"{self._worker_name} {threading.current_thread().name}")

    def __delitem__(self, ident: int) -> None:
        # Untagged first: this method's own time is not the task's.
        self._sampler.clear_thread_tag(ident)
        super().__delitem__(ident)


RUNNING = ("executing", "long-running")  # a seceded task is still running


class TaskLog:
    """Start and stop times of executed tasks, bounded, for the profile's metadata.

    Fed by the worker's `transition` hook on the event loop; summarised off it. Every
    plugin holding the worker's profiler feeds it: a transition seen twice counts once.
    """

    def __init__(self, maxlen: int) -> None:
        self._started: dict[Any, float] = {}
        self._done: RunLog[tuple[str, float, float]] = RunLog(maxlen)

    def transition(self, key: Any, start: str, finish: str) -> None:
        if finish in RUNNING:
            self._started.setdefault(key, time.time())
        elif start in RUNNING:
            began = self._started.pop(key, None)
            if began is not None:
                self._done.append((key_split(key), began, time.time()))

    def summary(self, start: float | None, stop: float | None) -> dict[str, dict[str, float]]:
        """Per task prefix: tasks that overlap the window, and their wall seconds inside it."""
        lo, hi = start or 0.0, stop or time.time()
        inside = ((prefix, min(ended, hi) - max(began, lo)) for prefix, began, ended in self._done.copy())
        return task_totals(run for run in inside if run[1] >= 0)


class WorkerProfiler:
    """A worker's half, set up once however many hold it (the worker preload and our
    plugin): the sampler hold, task tags, the task log and the RPC handlers."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.hold = SamplerHold(worker)
        self.tasks = TaskLog(config.get("task-history"))
        self.spans = SpanNames()
        self.holders = 0
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, worker: Worker) -> WorkerProfiler:
        """The worker's profiler, made on first use."""
        profiler = _profilers.get(worker)
        if profiler is None:
            profiler = _profilers[worker] = cls(worker)
        return profiler

    @staticmethod
    def held(worker: Worker) -> WorkerProfiler | None:
        """The worker's profiler, if anyone holds it."""
        return _profilers.get(worker)

    async def attach(self, opts: SamplerOptions) -> None:
        """One more holder; its options apply (the last given win, as for the process sampler)."""
        async with self._lock:
            self.holders += 1
            await self._apply(opts)
            if self.holders == 1:
                handlers: dict[str, Callable[..., Any]] = {
                    "pyspy_profile": self.profile,
                    "pyspy_size": self.size,
                    "pyspy_dump": self.dump,
                    "pyspy_configure": self.configure,
                    "pyspy_stalls": self.stalls,
                    "pyspy_memory": self.memory,
                }
                install_handlers(self.worker, handlers)

    async def detach(self) -> None:
        """One holder fewer; the last one tears the profiler down."""
        async with self._lock:
            self.holders -= 1
            if self.holders == 0:
                _profilers.pop(self.worker, None)
                remove_handlers(self.worker)
                await self.hold.release()
                self._tag_tasks()

    async def _apply(self, opts: SamplerOptions) -> None:
        before = self.hold.sampler
        await self.hold.apply(opts)
        if self.hold.sampler is not before:
            self._tag_tasks()

    def _tag_tasks(self) -> None:
        """Tag the threads' tasks for the held sampler; without one, stop tagging."""
        sampler = self.hold.sampler
        with self.worker.active_threads_lock:
            entries = dict(self.worker.active_threads)
            self.worker.active_threads = (
                entries if sampler is None else TaskTagger(sampler, self.worker, self.spans, entries)
            )

    def _check(self) -> Sampler:
        if self.hold.sampler is None:
            raise RuntimeError(f"sampling is off on worker {self.worker.address}: {self.hold.error}")
        return self.hold.sampler

    async def profile(
        self,
        start: float | None = None,
        stop: float | None = None,
        aggregate: bool = False,
        span_ids: list[str] | None = None,
    ) -> Serialize:
        """The window in the wire format, with the task log and span names; with
        `span_ids`, only the samples of tasks in those spans. Sent as a frame of its
        own: packed into the message, it would be copied on the event loop."""
        sampler = self._check()
        # Read on the loop, which owns the worker's state; only where memory is tracked.
        held = {"managed": managed_by_prefix(self.worker)} if sampler.options.memory else None

        def export() -> bytes:
            tasks = {self.worker.address: self.tasks.summary(start, stop)}
            meta = {"tasks": tasks}
            spans, ids = dict(self.spans.spans), self.spans.with_nested(span_ids)
            return sampler.export(start, stop, aggregate, self.worker.address, meta, spans, ids, held)

        return to_serialize(await off_loop(export))

    async def size(
        self,
        start: float | None = None,
        stop: float | None = None,
        aggregate: bool = False,
        span_ids: list[str] | None = None,
    ) -> dict[str, int]:
        """What `profile` would send: samples, and the decoded profile's approximate bytes."""
        sampler = self._check()
        return await off_loop(lambda: sampler.window_size(start, stop, aggregate, self.spans.with_nested(span_ids)))

    async def dump(self) -> dict[str, Any]:
        sampler = self._check()
        return {"process": self.worker.address, "pid": os.getpid(), **await off_loop(sampler.dump)}

    async def stalls(
        self, start: float | None = None, stop: float | None = None, min_duration: float = 0.0, most: int = 100
    ) -> dict[str, Any]:
        """This worker's event-loop stalls in the window (`Sampler.stalls`)."""
        sampler = self._check()
        return await off_loop(sampler.stalls, start, stop, min_duration, most)

    async def memory(self, start: float | None = None, stop: float | None = None) -> dict[str, Any]:
        """What this worker's memory tracking counted (`Sampler.memory`)."""
        sampler = self._check()
        return await off_loop(sampler.memory, start, stop)

    async def configure(self, sampler_options: dict[str, Any]) -> dict[str, str | None]:
        """New options from the scheduler (`SamplerOptions.to_dict`), applied in place:
        samples and task log are kept."""
        async with self._lock:
            await self._apply(SamplerOptions(**sampler_options))
        return {"error": self.hold.error}


_profilers: weakref.WeakKeyDictionary[Worker, WorkerProfiler] = weakref.WeakKeyDictionary()


class PySpyWorkerPlugin(WorkerPlugin):
    """Runs in each worker: holds the worker's profiler, which tags samples with task keys."""

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, sampler_options: SamplerOptions) -> None:
        self.sampler_options = sampler_options

    async def setup(self, worker: Worker) -> None:
        self.profiler = WorkerProfiler.of(worker)
        await self.profiler.attach(self.sampler_options)

    async def teardown(self, worker: Worker) -> None:
        await self.profiler.detach()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        self.profiler.tasks.transition(key, start, finish)
