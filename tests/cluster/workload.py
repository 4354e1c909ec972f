"""Task functions with distinct names, importable by worker processes."""

from __future__ import annotations

import os
import time


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def spin_until(path: str, most: float = 60.0) -> None:
    """Busy in Python until `path` exists: as long as a test needs, `most` seconds at most."""
    end = time.perf_counter() + most
    while not os.path.exists(path) and time.perf_counter() < end:
        spin(0.01)


def grind(seconds: float) -> None:
    """Busy like `spin`, with the loop in its own body: its time is its own self time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def spin_then_grind(i: int, spin_seconds: float, grind_seconds: float) -> int:
    spin(spin_seconds)
    grind(grind_seconds)
    return i


def alpha(i: int, seconds: float = 0.005) -> int:
    spin(seconds)
    return i


def beta(i: int, seconds: float = 0.002) -> int:
    spin(seconds)
    return i


def gamma(i: int, seconds: float = 0.3) -> int:
    spin(seconds)
    return i


def recurse(depth: int, seconds: float = 0.05) -> int:
    """A deep recursion that spins at its bottom."""
    if depth:
        return recurse(depth - 1, seconds)
    spin(seconds)
    return 0


def sleeper(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class Counter:
    """An actor: its method calls run in the worker's actor thread."""

    def work(self, seconds: float) -> int:
        spin(seconds)
        return 1


async def coroutine_task(seconds: float) -> float:
    import asyncio

    await asyncio.sleep(seconds)
    return seconds


def wait_io(i: int, seconds: float = 0.3) -> int:
    """Blocked on a socket: wall time without CPU or the GIL."""
    import socket

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(seconds)
        try:
            a.recv(1)
        except TimeoutError:
            pass
    return i


def matmul(i: int, n: int = 600, rounds: int = 8) -> float:
    """A numpy kernel: CPU time without the GIL. Returns the CPU seconds its thread used."""
    import numpy as np

    cpu = time.thread_time()
    m = np.random.default_rng(i).random((n, n))
    for _ in range(rounds):
        m = m @ m
        m /= m.max()
    return time.thread_time() - cpu


def spin_for(seconds: float) -> float:
    spin(seconds)
    return seconds


def blas_loop(i: int, seconds: float = 0.3) -> int:
    """Time in BLAS: native frames (gemm) under this Python line."""
    import numpy as np

    a = np.random.default_rng(i).random((200, 200))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
    return i


def hold_gil(n: int) -> int:
    """One C call that keeps the GIL throughout: the worker's event loop waits for it."""
    return sum(range(n))


def spin_on_loop(comm: object = None, seconds: float = 1.0) -> None:
    """A scheduler handler that keeps the event loop busy."""
    spin(seconds)


def sleep_on_loop(comm: object = None, seconds: float = 1.0) -> None:
    """A scheduler handler that blocks the event loop in a system call."""
    time.sleep(seconds)


def add_loop_handlers(dask_scheduler: object) -> None:
    dask_scheduler.handlers.update(spin_on_loop=spin_on_loop, sleep_on_loop=sleep_on_loop)  # type: ignore[attr-defined]


def a_task_whose_function_name_is_wider_than_its_frame(i: int, seconds: float = 0.002) -> int:
    spin(seconds)
    return i
