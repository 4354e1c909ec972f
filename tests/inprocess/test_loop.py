"""Heavy work leaves the event loop's thread the CPU; light blocking work does not
pass a lowered priority on to the threads it starts."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from dask_pyspy._loop import NICE, in_thread, off_loop


def nice_here() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux sets nice per thread")
def test_heavy_work_runs_at_a_lower_priority_than_the_loop():
    async def both() -> tuple[int, int]:
        return await off_loop(nice_here), await in_thread(nice_here)

    loop_nice = nice_here()
    assert asyncio.run(both()) == (min(19, loop_nice + NICE), loop_nice)
