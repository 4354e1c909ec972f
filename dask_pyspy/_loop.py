"""Keeping blocking work off the server's event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

# Concurrent jobs per process: a dashboard render beside a collection. The threads keep
# the loop's priority: they hold the GIL for the Python around a job, and a nicer
# thread preempted while holding it stalled the loop. The native core runs the heavy
# part of a job without the GIL, at low priority (rust/priority.rs).
THREADS = 2

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's pool; a forked child makes its own (the parent's threads do
    not exist there)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(THREADS, thread_name_prefix="pyspy-job"))
        return _pool[1]


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a thread of this process's pool: export, merge, compression,
    rendering and starting the sampler never block the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)
