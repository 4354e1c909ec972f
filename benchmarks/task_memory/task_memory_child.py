"""One measurement of the memory-per-task benchmark (see task_memory.py), in its own
process: argv[1] is JSON {"mode": ..., ...}; the result is JSON on the last line of stdout."""

from __future__ import annotations

import json
import sys
import threading
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

from dask_pyspy import Sampler

MIB = 2**20


def python_objects() -> None:
    """Many small objects made and dropped: the hooks' worst case."""
    for _ in range(10):
        x = [{"a": i, "b": (i, str(i))} for i in range(100_000)]
        del x


def numpy_temporaries() -> None:
    """An expression's temporaries, 8 MB each, 400 times."""
    a = np.random.default_rng(0).random((1000, 1000))
    for _ in range(400):
        b = (a * 2 + 1) / 3 - a
        b.sum()


WORK: dict[str, Callable[[], None]] = {"python": python_objects, "numpy": numpy_temporaries}


def timed(work: str, memory: bool) -> float:
    """Seconds of one run of `work`, with the sampler at 100 Hz and memory tracking or not."""
    s = Sampler(memory=memory)
    s.start()
    try:
        began = time.perf_counter()
        WORK[work]()
        return time.perf_counter() - began
    finally:
        s.stop()


def cost(work: str, pairs: int) -> dict[str, Any]:
    """Runs of `work` with tracking off and on in pairs, in turn first: a neighbour's load
    on a shared machine comes and goes over seconds, and falls on both runs of a pair."""
    WORK[work]()  # warm
    out: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(pairs):
        for memory in (False, True) if i % 2 == 0 else (True, False):
            out["on" if memory else "off"].append(timed(work, memory))
    return out


def objects() -> list[Any]:
    return [(str(i) * 20, [i, i + 1]) for i in range(1_000_000)]


def arrays() -> list[Any]:
    return [np.ones(MIB * (1 + i % 4) // 8) for i in range(80)]


def accuracy(by: str) -> dict[str, float]:
    """The bytes ~200 MB of Python objects and of numpy arrays hold, by our samples or by
    tracemalloc's exact count, each alone in its process (tracemalloc started over our
    hooks allocates its own records through them); numpy's own sizes beside."""
    made: dict[str, float] = {}
    kept: list[Any] = []
    if by == "tracemalloc":
        tracemalloc.start()
        for name, make in (("objects", objects), ("arrays", arrays)):
            before = tracemalloc.get_traced_memory()[0]
            kept.append(make())
            made[name] = tracemalloc.get_traced_memory()[0] - before
        made["nbytes"] = sum(a.nbytes for a in kept[-1])
        tracemalloc.stop()
        return made
    s = Sampler(memory=True)
    s.start()
    ident = threading.get_ident()
    for name, make in (("objects", objects), ("arrays", arrays)):
        s.set_thread_tag(ident, f"('{name}', 0)", name)
        kept.append(make())
        s.clear_thread_tag(ident)
    made = {row["prefix"]: row["in_use"] for row in s.memory()["prefixes"] if row["prefix"]}
    s.stop()
    return made


def at_depth(depth: int, call: Callable[[], float]) -> float:
    return call() if depth == 0 else at_depth(depth - 1, call)


def walk(depth: int, stacks: bool) -> dict[str, float]:
    """Seconds per allocation of 2 MiB blocks made `depth` calls deep, nearly each one
    sampled (at a mean of 512 KiB, 98%); with `stacks`, each sample's stack is walked
    (the fast reader), else not (py-spy's reader names no stacks). The blocks come from
    `PyMem_RawMalloc` through ctypes, never written: zeroing them would cost 20 times
    the walk. The best of 5."""
    import ctypes

    malloc, free = ctypes.pythonapi.PyMem_RawMalloc, ctypes.pythonapi.PyMem_RawFree
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    count = 20_000

    def allocate() -> float:
        began = time.perf_counter()
        for _ in range(count):
            free(malloc(2 * MIB))
        return time.perf_counter() - began

    s = Sampler(memory=True, reader="fast" if stacks else "pyspy")
    s.start()
    try:
        times = [at_depth(depth, allocate) for _ in range(5)]
    finally:
        s.stop()
    return {"seconds": min(times) / count}


MODES: dict[str, Callable[..., dict[str, Any]]] = {"cost": cost, "accuracy": accuracy, "walk": walk}


def main() -> None:
    args = json.loads(sys.argv[1])
    print(json.dumps(MODES[args.pop("mode")](**args)))


if __name__ == "__main__":
    main()
