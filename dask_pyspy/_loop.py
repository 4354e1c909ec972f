"""Keeping blocking work off an event loop: a server's, or an asynchronous client's."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

# Concurrent jobs per process: a dashboard render beside a collection. The threads keep
# the loop's priority: they hold the GIL for the Python around a job, and a nicer
# thread preempted while holding it stalled the loop. The native core runs the heavy
# part of a job without the GIL, at low priority (rust/priority.rs).
THREADS = 2


class _Jobs:
    """A pool that exists only while it has jobs: the last job to finish shuts it down,
    so a process whose servers closed keeps no thread of ours."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._running = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="pyspy-job")
            self._running += 1
            future = self._pool.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._pool is not None:
                # From the pool's own thread: it ends once this callback returns.
                self._pool.shutdown(wait=False)
                self._pool = None


_jobs = _Jobs()


def _after_fork_in_child() -> None:
    # The parent's threads, and any lock they held, do not exist in the child.
    global _jobs
    _jobs = _Jobs()


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_background(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run `fn` in a thread of this process's pool, from any thread, without waiting."""
    return _jobs.submit(fn, *args)


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a thread of this process's pool: export, merge, compression,
    rendering and starting the sampler never block the event loop."""
    return await asyncio.wrap_future(_jobs.submit(fn, *args))
