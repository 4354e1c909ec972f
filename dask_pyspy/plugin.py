"""The scheduler and worker plugins: start the process sampler, tag samples with
task keys, and answer the `pyspy_profile` / `pyspy_dump` RPCs."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Any, Callable

from dask.utils import key_split
from distributed import Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.protocol.pickle import dumps

from dask_pyspy import _native, config, options
from dask_pyspy._loop import off_loop
from dask_pyspy.profile import task_totals
from dask_pyspy.sampler import Sampler, process_sampler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pyspy"
HANDLERS = ("pyspy_profile", "pyspy_size", "pyspy_dump", "pyspy_configure")
# The scheduler's event topic where its handlers' "start" and "close" are logged, so a
# client can ask whether they are there: calling a missing one logs a traceback there.
EVENT_TOPIC = "dask-pyspy"


class SamplerHold:
    """A server's hold on the process sampler. A sampler that cannot run turns sampling
    off in this server, with the reason; the server keeps running."""

    def __init__(self) -> None:
        self.sampler: Sampler | None = None
        self.error: str | None = None

    async def apply(self, opts: dict[str, Any]) -> None:
        """Hold the sampler, running with `opts`: acquired the first time, reconfigured after."""
        try:
            if self.sampler is None:
                self.sampler = await off_loop(process_sampler.acquire, opts)
            else:
                await off_loop(process_sampler.configure, opts)
            self.error = None
        except Exception as e:  # an unreadable interpreter must not take the server down
            logger.error("dask-pyspy: sampling is off in this process: %s", e)
            self.error = f"{type(e).__name__}: {e}"
            await self.release()

    async def release(self) -> None:
        if self.sampler is not None:
            self.sampler = None
            await off_loop(process_sampler.release)


def install_handlers(server: Scheduler | Worker, handlers: dict[str, Callable[..., Any]]) -> None:
    server.handlers.update(handlers)


def remove_handlers(server: Scheduler | Worker) -> None:
    for name in HANDLERS:
        server.handlers.pop(name, None)


def rejected(error: ValueError) -> dict[str, str]:
    """The answer to a request the caller got wrong: returned rather than raised, so the
    server logs one line instead of an error with a traceback."""
    logger.info("dask-pyspy: rejected a request: %s", error)
    return {"error": str(error)}


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
        self._done: deque[tuple[str, float, float]] = deque(maxlen=maxlen)

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
        done = list(self._done)  # one C-level copy: safe from another thread
        inside = ((prefix, min(ended, hi) - max(began, lo)) for prefix, began, ended in done)
        return task_totals(run for run in inside if run[1] >= 0)


class WorkerProfiler:
    """A worker's half, set up once however many hold it (the worker preload and our
    plugin): the sampler hold, task tags, the task log and the RPC handlers."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.hold = SamplerHold()
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

    async def attach(self, opts: dict[str, Any]) -> None:
        """One more holder; its options apply (the last given win, as for the process sampler)."""
        async with self._lock:
            self.holders += 1
            await self._apply(opts)
            if self.holders == 1:
                handlers = {"pyspy_profile": self.profile, "pyspy_size": self.size, "pyspy_dump": self.dump, "pyspy_configure": self.configure}
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

    async def _apply(self, opts: dict[str, Any]) -> None:
        before = self.hold.sampler
        await self.hold.apply(opts)
        if self.hold.sampler is not before:
            self._tag_tasks()

    def _tag_tasks(self) -> None:
        """Tag the threads' tasks for the held sampler; without one, stop tagging."""
        sampler = self.hold.sampler
        with self.worker.active_threads_lock:
            entries = dict(self.worker.active_threads)
            self.worker.active_threads = entries if sampler is None else TaskTagger(sampler, self.worker, self.spans, entries)

    def _check(self) -> Sampler:
        if self.hold.sampler is None:
            raise RuntimeError(f"sampling is off on worker {self.worker.address}: {self.hold.error}")
        return self.hold.sampler

    async def profile(self, start: float | None = None, stop: float | None = None, aggregate: bool = False) -> bytes:
        """The window in the wire format, with the task log and span names."""
        sampler = self._check()

        def export() -> bytes:
            tasks = {self.worker.address: self.tasks.summary(start, stop)}
            return sampler.export(start, stop, aggregate, self.worker.address, {"tasks": tasks}, dict(self.spans.spans))

        return await off_loop(export)

    async def size(self, start: float | None = None, stop: float | None = None, aggregate: bool = False) -> dict[str, int]:
        """What `profile` would send: samples, and the decoded profile's approximate bytes."""
        return await off_loop(self._check().window_size, start, stop, aggregate)

    async def dump(self) -> dict[str, Any]:
        sampler = self._check()
        return {"process": self.worker.address, "pid": os.getpid(), **await off_loop(sampler.dump)}

    async def configure(self, sampler_options: dict[str, Any]) -> dict[str, str | None]:
        """New options from the scheduler, applied in place: samples and task log are kept."""
        async with self._lock:
            await self._apply(sampler_options)
        return {"error": self.hold.error}


_profilers: weakref.WeakKeyDictionary[Worker, WorkerProfiler] = weakref.WeakKeyDictionary()


class PySpyWorkerPlugin(WorkerPlugin):
    """Runs in each worker: holds the worker's profiler, which tags samples with task keys."""

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, sampler_options: dict[str, Any]) -> None:
        self.sampler_options = sampler_options

    async def setup(self, worker: Worker) -> None:
        self.profiler = WorkerProfiler.of(worker)
        await self.profiler.attach(self.sampler_options)

    async def teardown(self, worker: Worker) -> None:
        await self.profiler.detach()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        self.profiler.tasks.transition(key, start, finish)


SCHEDULER = "scheduler"
SLACK_BYTES = 1 << 20  # samples a process takes between saying its size and sending


def too_large(total: int, cap: int, sizes: dict[str, dict[str, int]], aggregate: bool) -> str:
    samples = sum(size["samples"] for size in sizes.values())
    shorter = "a shorter window (last=, or start= and stop=)"
    return (
        f"the profile would take about {total / 2**20:.0f} MiB ({samples} samples from {len(sizes)} processes), "
        f"over config pyspy.max-result ({cap / 2**20:.0f} MiB): ask for {shorter if aggregate else 'aggregate=True or ' + shorter}, "
        "or fewer workers, or raise pyspy.max-result"
    )


def checked_parts(replies: dict[str, Any], sizes: dict[str, dict[str, int]], missing: dict[str, str]) -> tuple[dict[str, bytes], list[str]]:
    """The replies that are wire bytes no larger than announced, by process, and the
    span ids they hold; the rest are named in `missing`. Only heads are read: the
    client decodes the samples (and names a part it cannot decode)."""
    parts, span_ids = {}, set()
    for name, data in replies.items():
        announced = sizes[name]["bytes"]
        allowed = announced * 11 // 10 + SLACK_BYTES
        try:
            if not isinstance(data, bytes):
                raise ValueError(f"an answer of type {type(data).__name__}, not a profile")
            if len(data) > allowed:
                raise ValueError(f"{len(data)} bytes, more than the {announced} it announced")
            head = _native.Profile.wire_head(data)
            if head["memory_bytes"] > allowed:
                raise ValueError(f"a profile of {head['memory_bytes']} bytes, more than the {announced} it announced")
        except ValueError as e:
            missing[name] = f"an unusable profile: {e}"
            continue
        parts[name] = data
        span_ids.update(head["span_ids"])
    return parts, sorted(span_ids)


def is_span_id(text: str) -> bool:
    """Whether `text` reads as a span id (distributed makes them with uuid4)."""
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def listed(items: list[Any], most: int = 20) -> str:
    shown = ", ".join(map(repr, items[:most]))
    return shown + (f", ... ({len(items)} in all)" if len(items) > most else "")


def check_span(ext: Any, span: str | list[str] | None) -> None:
    """Refuse a span name or path that no span on the scheduler has, as an unknown
    worker is refused, rather than answer with no samples. An id passes even when the
    scheduler does not know it: samples keep the id of a span it cannot name."""
    if span is None or ext is None:
        return
    # .get, and skipping empty lists: distributed's own lookups leave empty entries.
    if isinstance(span, str):
        if ext.spans_search_by_tag.get(span) or span in ext.spans or is_span_id(span):
            return
        names = sorted(name for name, spans in ext.spans_search_by_tag.items() if spans)
        raise ValueError(f"span: no span is named {span!r} or has that id; span names: {listed(names)}")
    if ext.spans_search_by_name.get(tuple(span)) or (len(span) == 1 and is_span_id(span[0])):
        return
    paths = sorted(path for path, spans in ext.spans_search_by_name.items() if spans)
    raise ValueError(f"span: no span has the path {tuple(span)!r}; span paths: {listed(paths)}")


class ClusterProfiler:
    """The scheduler's half: its sampler hold, the RPC handlers, the dashboard pages and
    the options every worker samples with. It outlives a re-registered `PySpyPlugin`,
    which hands it the new options."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.hold = SamplerHold()
        self.sampler_options: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def start(self, opts: dict[str, Any]) -> None:
        # Imported here, on the scheduler only: workers start (and restart) without the pages.
        from dask_pyspy.dashboard import add_routes

        self.sampler_options = opts
        await self.hold.apply(opts)
        install_handlers(self.scheduler, {"pyspy_profile": self.profile, "pyspy_dump": self.dump})
        self.scheduler.log_event(EVENT_TOPIC, {"action": "start"})
        add_routes(self.scheduler, self)
        await self.scheduler.register_worker_plugin(
            None, dumps(PySpyWorkerPlugin(opts)), name=PLUGIN_NAME, idempotent=False
        )

    async def apply(self, opts: dict[str, Any]) -> None:
        """New options for the scheduler, every worker and future workers; samples are kept."""
        async with self._lock:
            if opts == self.sampler_options:
                return
            timeout = config.timeout()  # a bad config fails the registration before anything changes
            self.sampler_options = opts
            await self.hold.apply(opts)
            # Future workers set up with these; current ones apply them in place, since
            # registering the worker plugin again would tear down each worker's task log.
            self.scheduler.worker_plugins[PLUGIN_NAME] = dumps(PySpyWorkerPlugin(opts))
            addresses = list(self.scheduler.workers)
            replies, missing = await self._ask_workers(addresses, "pyspy_configure", timeout, sampler_options=opts)
            missing.update((addr, reply["error"]) for addr, reply in replies.items() if reply["error"])
            if missing:
                logger.warning("dask-pyspy: workers that could not take the new sampler options: %s", missing)

    async def close(self) -> None:
        remove_handlers(self.scheduler)
        self.scheduler.log_event(EVENT_TOPIC, {"action": "close"})
        await self.hold.release()

    def select_workers(self, workers: Any) -> list[str]:
        known = list(self.scheduler.workers)
        workers = options.workers(workers)
        if workers is None:
            return known
        if isinstance(workers, int):
            return random.sample(known, min(workers, len(known)))
        chosen = [self.scheduler.aliases.get(w, w) for w in workers]
        unknown = [w for w, a in zip(workers, chosen) if a not in self.scheduler.workers]
        if unknown:
            raise ValueError(f"workers: unknown worker addresses {unknown}; the cluster has {known}")
        return chosen

    async def _ask_workers(self, addresses: list[str], op: str, timeout: float, **kwargs: Any) -> tuple[dict[str, Any], dict[str, str]]:
        """Ask workers concurrently; failures and time-outs are named, never fatal."""

        async def ask(addr: str) -> Any:
            return await asyncio.wait_for(getattr(self.scheduler.rpc(addr), op)(**kwargs), timeout)

        replies = await asyncio.gather(*(ask(a) for a in addresses), return_exceptions=True)
        ok: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for addr, reply in zip(addresses, replies):
            if isinstance(reply, asyncio.TimeoutError):
                missing[addr] = f"no answer within {timeout:g} s"
            elif isinstance(reply, BaseException):
                missing[addr] = f"{type(reply).__name__}: {reply}"
            elif reply is None:
                missing[addr] = f"the worker has no {op} handler (the plugin is not set up there)"
            else:
                ok[addr] = reply
        return ok, missing

    def _span_names(self, ids: list[str]) -> dict[str, dict[str, list[str]]]:
        """Names and id paths of the spans with these ids that the scheduler knows."""
        ext = self.scheduler.extensions.get("spans")
        out = {}
        for span_id in ids:
            span = ext.spans.get(span_id) if ext is not None else None
            if span is None:
                continue
            path, node = [], span
            while node is not None:
                path.append(node.id)
                node = node.parent
            out[span_id] = {"names": list(span.name), "ids": path[::-1]}
        return out

    async def profile(
        self,
        workers: Any = None,
        scheduler: bool = True,
        start: float | None = None,
        stop: float | None = None,
        timeout: float | None = None,
        span: str | list[str] | None = None,
        aggregate: bool = False,
    ) -> dict[str, Any]:
        """Every selected process's samples of `[start, stop]` as wire parts, for the
        client to merge (`dask_pyspy.client.assemble`): the scheduler only relays them,
        so its memory stays near the bytes it receives. First each process says how
        large its part is; a request over `pyspy.max-result` is refused before any
        sample moves."""
        try:
            start, stop = options.window(start, stop)
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
            span = options.span(span)
            check_span(self.scheduler.extensions.get("spans"), span)
            aggregate = options.flag("aggregate", aggregate)
            scheduler = options.flag("scheduler", scheduler)
            cap = config.max_result()
        except ValueError as e:
            return rejected(e)
        stop = max(time.time(), start or 0.0) if stop is None else stop
        window = {"start": start, "stop": stop, "aggregate": aggregate}
        own = self.hold.sampler if scheduler else None
        sizes, missing = await self._sizes(addresses, own, timeout, window)
        if scheduler and own is None:
            missing[SCHEDULER] = f"sampling is off on the scheduler: {self.hold.error}"
        total = sum(size["bytes"] for size in sizes.values())
        if total > cap:
            return rejected(ValueError(too_large(total, cap, sizes, aggregate)))
        replies, failed = await self._ask_workers([a for a in sizes if a != SCHEDULER], "pyspy_profile", timeout, **window)
        missing.update(failed)
        if own is not None:
            name = f"scheduler {self.scheduler.address}"
            replies[SCHEDULER] = await off_loop(own.export, start, stop, aggregate, name, {}, {})
        parts, span_ids = await off_loop(checked_parts, replies, sizes, missing)
        meta = {"window": [start, stop], "workers": addresses, "missing": missing, "collected": time.time(), "span": span, "aggregate": aggregate}
        return {"parts": parts, "spans": self._span_names(span_ids), "metadata": meta}

    async def _sizes(
        self, addresses: list[str], own: Sampler | None, timeout: float, window: dict[str, Any]
    ) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        """What each process would send (the scheduler's own with `own`); one that cannot say is missing."""
        replies, missing = await self._ask_workers(addresses, "pyspy_size", timeout, **window)
        sizes = {}
        for addr, reply in replies.items():
            if isinstance(reply, dict) and all(isinstance(reply.get(k), int) for k in ("samples", "bytes")):
                sizes[addr] = reply
            else:
                missing[addr] = f"an unreadable size reply: {reply!r:.100}"
        if own is not None:
            sizes[SCHEDULER] = await off_loop(own.window_size, window["start"], window["stop"], window["aggregate"])
        return sizes, missing

    async def dump(self, workers: Any = None, scheduler: bool = True, timeout: float | None = None) -> dict[str, Any]:
        try:
            addresses = self.select_workers(workers)
            timeout = config.timeout(timeout)
        except ValueError as e:
            return rejected(e)
        replies, missing = await self._ask_workers(addresses, "pyspy_dump", timeout)
        sampler = self.hold.sampler
        if scheduler and sampler is not None:
            replies[SCHEDULER] = {"process": f"scheduler {self.scheduler.address}", "pid": os.getpid(), **await off_loop(sampler.dump)}
        return {"processes": replies, "missing": missing}


class PySpyPlugin(SchedulerPlugin):
    """Profile a whole dask cluster: `client.register_plugin(PySpyPlugin())`.

    Starts the in-process sampler in the scheduler and in every current and future
    worker. Options default to dask config (`pyspy.*`); see `dask_pyspy.Sampler`.
    Registering it again with other options applies them to every running sampler
    (and future workers), keeping the samples taken so far; with the same options it
    does nothing.
    """

    # Not idempotent: distributed would skip a re-registration, and its new options with it.
    idempotent = False
    name = PLUGIN_NAME

    def __init__(
        self,
        rate: float | None = None,
        idle: bool | None = None,
        gil_only: bool | None = None,
        cpu_budget: float | None = None,
        max_memory: int | str | None = None,
        lines: bool | None = None,
        function: bool | None = None,
        reader: str | None = None,
    ) -> None:
        self.sampler_options = config.sampler_options(
            rate=rate, idle=idle, gil_only=gil_only, cpu_budget=cpu_budget,
            max_memory=max_memory, lines=lines, function=function, reader=reader,
        )
        Sampler(**self.sampler_options)  # bad options fail here, in the caller's process

    async def start(self, scheduler: Scheduler) -> None:
        current = scheduler.plugins.get(PLUGIN_NAME)
        if isinstance(current, PySpyPlugin) and current is not self:
            self.profiler = current.profiler
            await self.profiler.apply(self.sampler_options)
            # distributed adds this plugin next; removing the one it replaces first spares
            # the "overwriting" warning (the old one holds nothing of its own to close).
            scheduler.remove_plugin(PLUGIN_NAME)
        else:
            self.profiler = ClusterProfiler(scheduler)
            await self.profiler.start(self.sampler_options)

    async def close(self) -> None:
        await self.profiler.close()


async def dask_setup(server: Any) -> None:
    """Preload hook: `dask scheduler --preload dask_pyspy`, `dask worker --preload dask_pyspy`."""
    if isinstance(server, Scheduler):
        server.add_plugin(PySpyPlugin())  # its start() is awaited when the scheduler starts
    elif isinstance(server, Worker):
        # The scheduler's plugin, of the same name, replaces this one, so a worker holds one
        # plugin of ours however it was set up. The preload's own hold on the profiler, until
        # dask_teardown, keeps the profiler (task log, tags) through that replacement.
        opts = config.sampler_options()
        await WorkerProfiler.of(server).attach(opts)
        await server.plugin_add(PySpyWorkerPlugin(opts), name=PLUGIN_NAME)


async def dask_teardown(server: Any) -> None:
    """Preload hook at close (after the worker's plugins are gone): the preload's hold goes."""
    profiler = _profilers.get(server) if isinstance(server, Worker) else None
    if profiler is not None:  # None on a worker whose dask_setup failed
        await profiler.detach()
