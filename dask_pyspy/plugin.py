"""The scheduler and worker plugins: start the process sampler, tag samples with
task keys, and answer the `pyspy_profile` / `pyspy_dump` RPCs."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections import deque
from typing import Any, Callable

from dask.utils import key_split
from distributed import Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.protocol.pickle import dumps

from dask_pyspy import config, options
from dask_pyspy._loop import off_loop
from dask_pyspy.dashboard import add_routes
from dask_pyspy.profile import Profile
from dask_pyspy.sampler import Sampler, process_sampler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "pyspy"
HANDLERS = ("pyspy_profile", "pyspy_dump")


async def acquire_sampler(opts: dict[str, Any]) -> tuple[Sampler | None, str | None]:
    """The process sampler, or the reason it cannot run here (the server keeps running)."""
    try:
        return await off_loop(process_sampler.acquire, opts), None
    except Exception as e:  # an unreadable interpreter must not take the server down
        logger.error("dask-pyspy: sampling is off in this process: %s", e)
        return None, f"{type(e).__name__}: {e}"


def install_handlers(server: Scheduler | Worker, handlers: dict[str, Callable[..., Any]]) -> None:
    server.handlers.update(handlers)


def remove_handlers(server: Scheduler | Worker) -> None:
    for name in HANDLERS:
        server.handlers.pop(name, None)


class TaskTagger(dict):
    """`Worker.active_threads` that also tells the sampler which task each thread runs.

    distributed sets and deletes entries in the executing thread as a task starts and
    ends, so the sampler's tag is right at capture time (see `_run_task`).
    """

    def __init__(self, sampler: Sampler, worker_name: str, entries: dict[int, Any]) -> None:
        super().__init__(entries)
        self._sampler = sampler
        self._worker_name = worker_name
        self._named: set[int] = set()
        for ident, key in entries.items():
            self._tag(ident, key)

    def _tag(self, ident: int, key: Any) -> None:
        self._sampler.set_thread_tag(ident, str(key), key_split(key))

    def __setitem__(self, ident: int, key: Any) -> None:
        super().__setitem__(ident, key)
        self._tag(ident, key)
        if ident not in self._named:
            self._named.add(ident)
            self._sampler.set_thread_name(ident, f"{self._worker_name} {threading.current_thread().name}")

    def __delitem__(self, ident: int) -> None:
        super().__delitem__(ident)
        self._sampler.clear_thread_tag(ident)


RUNNING = ("executing", "long-running")  # a seceded task is still running


class TaskLog:
    """Start and stop times of executed tasks, bounded, for the profile's metadata.

    Fed by the worker's `transition` hook on the event loop; summarised off it.
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
        out: dict[str, dict[str, float]] = {}
        for prefix, began, ended in list(self._done):  # one C-level copy: safe from another thread
            inside = min(ended, hi) - max(began, lo)
            if inside >= 0:
                entry = out.setdefault(prefix, {"count": 0, "seconds": 0.0})
                entry["count"] += 1
                entry["seconds"] += inside
        return out


class PySpyWorkerPlugin(WorkerPlugin):
    """Runs in each worker: shares the process sampler and tags samples with task keys."""

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, sampler_options: dict[str, Any]) -> None:
        self.sampler_options = sampler_options

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.tasks = TaskLog(config.get("task-history"))
        self.sampler, self.error = await acquire_sampler(self.sampler_options)
        if self.sampler is not None:
            with worker.active_threads_lock:
                worker.active_threads = TaskTagger(self.sampler, worker.address, worker.active_threads)
        install_handlers(worker, {"pyspy_profile": self.profile, "pyspy_dump": self.dump})

    async def teardown(self, worker: Worker) -> None:
        remove_handlers(worker)
        if self.sampler is not None:
            with worker.active_threads_lock:
                worker.active_threads = dict(worker.active_threads)
            await off_loop(process_sampler.release)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        self.tasks.transition(key, start, finish)

    def _check(self) -> Sampler:
        if self.sampler is None:
            raise RuntimeError(f"sampling is off on worker {self.worker.address}: {self.error}")
        return self.sampler

    async def profile(self, start: float | None = None, stop: float | None = None) -> bytes:
        sampler = self._check()

        def export() -> bytes:
            tasks = {self.worker.address: self.tasks.summary(start, stop)}
            p = sampler.profile(start, stop, name=self.worker.address)
            return p.with_metadata(tasks=tasks).to_wire()

        return await off_loop(export)

    async def dump(self) -> dict[str, Any]:
        sampler = self._check()
        return {"process": self.worker.address, "pid": os.getpid(), **await off_loop(sampler.dump)}


class PySpyPlugin(SchedulerPlugin):
    """Profile a whole dask cluster: `client.register_plugin(PySpyPlugin())`.

    Starts the in-process sampler in the scheduler and in every current and future
    worker. Options default to dask config (`pyspy.*`); see `dask_pyspy.Sampler`.
    """

    idempotent = True
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
        self.scheduler = scheduler
        self.sampler, self.error = await acquire_sampler(self.sampler_options)
        install_handlers(scheduler, {"pyspy_profile": self.profile, "pyspy_dump": self.dump})
        add_routes(scheduler, self)
        await scheduler.register_worker_plugin(
            None, dumps(PySpyWorkerPlugin(self.sampler_options)), name=PLUGIN_NAME, idempotent=False
        )

    async def close(self) -> None:
        remove_handlers(self.scheduler)
        if self.sampler is not None:
            await off_loop(process_sampler.release)

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

    def _own_profile(self, start: float | None, stop: float | None) -> Profile | None:
        if self.sampler is None:
            return None
        return self.sampler.profile(start, stop, name=f"scheduler {self.scheduler.address}")

    async def profile(
        self,
        workers: Any = None,
        scheduler: bool = True,
        start: float | None = None,
        stop: float | None = None,
        timeout: float | None = None,
    ) -> bytes:
        """Every selected process's samples of `[start, stop]`, merged, as wire bytes."""
        start, stop = options.window(start, stop)
        stop = max(time.time(), start or 0.0) if stop is None else stop
        addresses = self.select_workers(workers)
        timeout = config.timeout(timeout)
        replies, missing = await self._ask_workers(addresses, "pyspy_profile", timeout, start=start, stop=stop)
        if scheduler and self.sampler is None:
            missing["scheduler"] = f"sampling is off on the scheduler: {self.error}"

        def merge() -> bytes:
            parts = [Profile.from_wire(b) for b in replies.values()]
            own = self._own_profile(start, stop) if scheduler else None
            meta = {"window": [start, stop], "workers": addresses, "missing": missing, "collected": time.time()}
            return Profile.merge(parts + ([own] if own else []), **meta).to_wire()

        return await off_loop(merge)

    async def dump(self, workers: Any = None, scheduler: bool = True, timeout: float | None = None) -> dict[str, Any]:
        addresses = self.select_workers(workers)
        timeout = config.timeout(timeout)
        replies, missing = await self._ask_workers(addresses, "pyspy_dump", timeout)
        if scheduler and self.sampler is not None:
            replies["scheduler"] = {"process": f"scheduler {self.scheduler.address}", "pid": os.getpid(), **await off_loop(self.sampler.dump)}
        return {"processes": replies, "missing": missing}


async def dask_setup(server: Any) -> None:
    """Preload hook: `dask scheduler --preload dask_pyspy`, `dask worker --preload dask_pyspy`."""
    if isinstance(server, Scheduler):
        server.add_plugin(PySpyPlugin())  # its start() is awaited when the scheduler starts
    elif isinstance(server, Worker):
        await server.plugin_add(PySpyWorkerPlugin(config.sampler_options()), name=PLUGIN_NAME)
