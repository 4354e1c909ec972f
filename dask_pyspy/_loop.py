"""Keeping heavy work off the server's event loop, and out of its way for the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

# How much nicer than the loop the threads doing the profiler's heavy work are. Off
# the loop is not enough: a collection exports in every worker at once, and on a busy
# machine the event loops then stalled 50-600 ms waiting for a CPU (sampled runnable,
# not running) while those threads ran. 10 nicer (weight 110 against 1024), they
# give way to a woken loop thread.
NICE = 10
THREADS = 2  # concurrent heavy jobs per process: a dashboard render beside a collection

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    # Linux nice is per thread (setpriority on a thread id); elsewhere it is per process.
    # A refusal (a sandbox) leaves the thread as it was: a failing initializer would
    # break the pool, and every collection with it.
    if sys.platform == "linux":
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))


def _executor() -> ThreadPoolExecutor:
    """The low-priority pool of this process; a forked child makes its own (the
    parent's threads do not exist there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = ThreadPoolExecutor(THREADS, thread_name_prefix="pyspy-heavy", initializer=_lower_priority)
            _pool = (os.getpid(), pool)
        return _pool[1]


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a low-priority thread: export, merge, compression and rendering
    never block the event loop, nor take the CPU from it."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn`, light but blocking, in a thread of normal priority: a thread it starts
    (the sampling thread) inherits that priority."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
