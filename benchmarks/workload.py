"""Task functions for benchmark clusters (importable by worker processes)."""

from __future__ import annotations

import time


def cpu_task(i: int, seconds: float = 0.03) -> int:
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(range(100))
    return n


def tiny(i: int) -> int:
    return i + 1




def task_1ms(i: int) -> int:
    return cpu_task(i, 0.001)


def task_10ms(i: int) -> int:
    return cpu_task(i, 0.01)


def task_100ms(i: int) -> int:
    return cpu_task(i, 0.1)
