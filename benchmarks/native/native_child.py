"""One measurement of the native-frames benchmark (see native.py), in its own process:
argv[1] is JSON {"mode": ..., ...}; the result is JSON on the last line of stdout."""

from __future__ import annotations

import os

# Before numpy loads OpenBLAS: BLAS runs in the calling thread, where it is sampled.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ctypes
import ctypes.util
import errno
import functools
import itertools
import json
import sys
import threading
import time
from typing import Any, Callable

from dask_pyspy import Sampler, _native
from dask_pyspy.model import Profile

Step = Callable[[], object]

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
libc.qsort.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, COMPARE]
libc.qsort.restype = None


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def compare(a: Any, b: Any) -> int:
    """The Python comparator qsort calls back (native_agreement.py looks for this name)."""
    return a[0] - b[0]


COMPARATOR = COMPARE(compare)


def sort_with_qsort(values: list[int]) -> None:
    """libc's qsort with a Python comparator: Python -> C -> Python on one stack."""
    array = (ctypes.c_int * len(values))(*values)
    libc.qsort(array, len(array), ctypes.sizeof(ctypes.c_int), COMPARATOR)


def jobs(rows: int = 3_000_000) -> dict[str, Step]:
    """One step of each job, with its data made up front (before sampling starts)."""
    import numpy as np
    import pandas as pd  # type: ignore[import-untyped]
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    rng = np.random.default_rng(0)
    square = rng.random((384, 384))
    values = pa.array(rng.integers(0, 1 << 40, 1_000_000))
    frame = pd.DataFrame({"k": rng.integers(0, 1000, rows), "v": rng.random(rows)})
    ints = [int(x) for x in rng.integers(0, 1 << 30, 3000)]
    draws = np.random.default_rng(1)

    def matmul() -> object:
        return square @ square

    def arrow_sort_take() -> object:
        return pc.take(values, pc.sort_indices(values))

    def groupby_sum() -> object:
        return frame.groupby("k")["v"].sum()

    def random_draws() -> object:
        return draws.random(2_000_000), draws.normal(size=2_000_000)

    def qsort_python() -> object:
        sort_with_qsort(ints)
        return ints

    return {
        "matmul": matmul,
        "arrow": arrow_sort_take,
        "groupby": groupby_sum,
        "random": random_draws,
        "qsort": qsort_python,
    }


def loop(steps: list[Step], stop: threading.Event) -> None:
    """The steps one after the other until `stop`."""
    for step in itertools.cycle(steps):
        if stop.is_set():
            return
        step()


def in_turn(steps: list[Step], stop: threading.Event, slice_s: float = 0.05) -> None:
    """Each step repeated for `slice_s`, then the next, until `stop`."""
    for step in itertools.cycle(steps):
        until = time.perf_counter() + slice_s
        while time.perf_counter() < until:
            if stop.is_set():
                return
            step()


def start_threads(
    targets: dict[str, Callable[[threading.Event], None]],
) -> tuple[list[threading.Thread], threading.Event]:
    stop = threading.Event()
    threads = [threading.Thread(target=t, args=(stop,), name=name, daemon=True) for name, t in targets.items()]
    for t in threads:
        t.start()
    return threads, stop


def stop_threads(threads: list[threading.Thread], stop: threading.Event) -> None:
    stop.set()
    for t in threads:
        t.join()


#: The thread states of samples on a CPU or waiting for one, as py-spy keeps threads.
RUNNING = ("cpu", "cpu-gil", "cpu-wait")


def agreement(layout: str, out: str = "", running: str = "") -> dict[str, Any]:
    """The workload in 4 threads ("together") or one thread ("in turn"), sampled from
    "ready" until a line on stdin (the parent runs py-spy in between); the profile goes
    to `out` as speedscope JSON, and its samples of threads in `RUNNING` to `running`.
    Without `out`, not sampled: py-spy's alone."""
    j = jobs()
    if layout == "together":
        targets: dict[str, Callable[[threading.Event], None]] = {
            "work-0": functools.partial(loop, [j["matmul"]]),
            "work-1": functools.partial(loop, [j["arrow"]]),
            "work-2": functools.partial(loop, [j["groupby"]]),
            "work-3": functools.partial(loop, [j["random"], j["qsort"]]),
        }
    else:
        targets = {"work-0": functools.partial(in_turn, list(j.values()))}
    threads, stop = start_threads(targets)
    time.sleep(1.0)  # past the threads' start
    s = Sampler(native=True, rate=100, cpu_budget=0.2) if out else None
    if s is not None:
        s.start()
    print("ready", flush=True)
    sys.stdin.readline()
    if s is not None:
        s.stop()
    stop_threads(threads, stop)
    if s is None:
        return {"stats": {}}
    profile = s.profile()
    with open(out, "w") as f:
        json.dump(profile.speedscope(), f)
    with open(running, "w") as f:
        json.dump(Profile(_native._testing.only_states(profile._native, list(RUNNING))).speedscope(), f)
    return {"stats": s.stats()}


def matmul_task(seed: int) -> float:
    import numpy as np

    a = np.random.default_rng(seed).random((500, 500))
    for _ in range(20):
        a = a @ a
        a /= a.max()
    return float(a.sum())


def cluster(seconds: float) -> dict[str, Any]:
    """A LocalCluster of 1 worker x 2 threads running numpy matmul tasks for about
    `seconds`, native=True: the seconds of task samples, and of those with a gemm frame."""
    from distributed import Client, LocalCluster

    import dask_pyspy

    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0") as c,
        Client(c) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin(native=True))
        client.gather(client.map(matmul_task, range(4), key=[f"warm-{i}" for i in range(4)]))
        start, seed = time.time(), 0
        while time.time() - start < seconds:
            client.gather(client.map(matmul_task, range(seed, seed + 20)))
            seed += 20
        doc = client.pyspy_profile(last=time.time() - start).speedscope()
    frames = doc["shared"]["frames"]
    out = {"task_s": 0.0, "gemm_s": 0.0}
    for p in doc["profiles"]:
        for stack, weight in zip(p["samples"], p["weights"]):
            names = [frames[i]["name"] for i in stack]
            if "matmul_task" in names:
                out["task_s"] += weight
                out["gemm_s"] += weight * any("gemm" in n for n in names)
    return out


def cost(native: bool, seconds: float, budget: float | None) -> dict[str, Any]:
    """4 busy numpy/pandas threads sampled at 100 Hz, with the default CPU budget unless given."""
    j = jobs(rows=1_000_000)
    threads, stop = start_threads(
        {f"busy-{i}": functools.partial(loop, [j[k]]) for i, k in enumerate(["matmul", "groupby"] * 2)}
    )
    time.sleep(1.0)
    s = Sampler(native=native, rate=100, **({} if budget is None else {"cpu_budget": budget}))
    s.start()
    time.sleep(seconds)
    s.stop()
    stop_threads(threads, stop)
    return {"stats": s.stats()}


def status_kib() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in KiB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile")}


def memory(native: bool, seconds: float) -> dict[str, Any]:
    """RSS before and after starting a sampler, with numpy, pandas and pyarrow imported
    and a thread in BLAS (whose arrays are made once: the RSS moves little but for the sampler)."""
    j = jobs(rows=1_000_000)
    threads, stop = start_threads({"work-0": functools.partial(loop, [j["matmul"]])})
    time.sleep(1.0)
    before = status_kib()
    s = Sampler(native=native, rate=100, cpu_budget=0.2)
    s.start()
    time.sleep(seconds)
    after = status_kib()
    s.stop()
    stop_threads(threads, stop)
    return {"before": before, "after": after, "stats": s.stats()}


class Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


def blocking_call(call: str) -> Callable[[], int]:
    """One libc call through ctypes that sleeps ~1 ms, and that a signal handler can cut
    short with EINTR: `nanosleep`, `sem_timedwait` on a semaphore nobody posts, or `select`
    on no descriptors. It returns the call's own return value (0 or -1, errno set)."""
    if call == "nanosleep":
        ts = Timespec(0, 1_000_000)
        return lambda: libc.nanosleep(ctypes.byref(ts), None)
    if call == "select":
        return lambda: libc.select(0, None, None, None, ctypes.byref(Timeval(0, 1000)))
    sem = ctypes.create_string_buffer(64)  # a sem_t is 32 bytes on 64-bit Linux
    if libc.sem_init(sem, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sem_init failed")

    def timedwait() -> int:
        now = time.time_ns() + 1_000_000  # sem_timedwait's deadline is on CLOCK_REALTIME
        r = libc.sem_timedwait(sem, ctypes.byref(Timespec(now // 1_000_000_000, now % 1_000_000_000)))
        return 0 if r != 0 and ctypes.get_errno() == errno.ETIMEDOUT else r  # the normal end

    return timedwait


def blocking_calls(case: str, call: str, count: int, a: Any) -> dict[str, int]:
    """`count` blocking calls of ~1 ms, back to back ("a") or each after ~1 ms of
    numpy/Python work ("b"); counts those that returned early with EINTR."""
    once = blocking_call(call)
    out = {"calls": 0, "eintr": 0, "other_errors": 0}
    for _ in range(count):
        if case == "b":
            until = time.perf_counter() + 0.001
            while time.perf_counter() < until:
                (a * 2.0).sum()
        if once() != 0:
            out["eintr" if ctypes.get_errno() == errno.EINTR else "other_errors"] += 1
        out["calls"] += 1
    return out


def eintr(case: str, call: str, count: int) -> dict[str, Any]:
    """A thread doing `count` blocking calls beside 2 busy numpy threads, sampled with native frames."""
    import numpy as np

    j = jobs(rows=10)
    threads, stop = start_threads({f"busy-{i}": functools.partial(loop, [j["matmul"]]) for i in range(2)})
    s = Sampler(native=True, rate=100, cpu_budget=0.2)
    s.start()
    result: dict[str, int] = {}
    caller = threading.Thread(
        target=lambda: result.update(blocking_calls(case, call, count, np.ones(1000))), name="caller", daemon=True
    )
    caller.start()
    caller.join()
    s.stop()
    stop_threads(threads, stop)
    return {**result, **caller_samples(s.profile().speedscope()), "stats": s.stats()}


def merge(seconds: float) -> dict[str, Any]:
    """2 numpy matmul threads and a qsort calling back a Python comparator, sampled with
    native frames: whether captures merge with the Python frames they copied on this
    interpreter. numpy only, so it runs on every interpreter of the matrix."""
    import numpy as np

    square = np.random.default_rng(0).random((384, 384))
    values = list(range(2000, 0, -1))
    steps: dict[str, Step] = {
        "work-0": lambda: square @ square,
        "work-1": lambda: square @ square,
        "work-2": lambda: sort_with_qsort(values),
    }
    threads, stop = start_threads({name: functools.partial(loop, [step]) for name, step in steps.items()})
    s = Sampler(native=True, rate=100, cpu_budget=0.2)
    s.start()
    time.sleep(seconds)
    s.stop()
    stop_threads(threads, stop)
    return {"python": sys.version.split()[0], "stats": s.stats(), "doc": s.profile().speedscope()}


def is_native(frame: dict[str, Any]) -> bool:
    """dask-pyspy's native frames have no line and a library for their file."""
    return "line" not in frame and not str(frame.get("file", "")).endswith(".py")


def caller_samples(doc: dict[str, Any]) -> dict[str, float]:
    """Seconds of the caller's samples, and of those with native frames (it was signalled)."""
    frames = doc["shared"]["frames"]
    out = {"caller_s": 0.0, "caller_native_s": 0.0}
    for p in doc["profiles"]:
        if " caller (" in p["name"]:
            for sample, weight in zip(p["samples"], p["weights"]):
                out["caller_s"] += weight
                out["caller_native_s"] += weight * any(is_native(frames[i]) for i in sample)
    return out


MODES: dict[str, Callable[..., dict[str, Any]]] = {
    "agreement": agreement,
    "cluster": cluster,
    "cost": cost,
    "memory": memory,
    "eintr": eintr,
    "merge": merge,
}

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(MODES[args.pop("mode")](**args)), flush=True)
