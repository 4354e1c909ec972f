"""Native (C, C++, Rust) frames captured in-process, merged with the Python frames."""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable

import pytest

from dask_pyspy import Sampler, _native
from tests.conftest import FAST_WORKS, FREE_THREADED, wait_for
from tests.inprocess.test_sampler import Threads

pytestmark = pytest.mark.skipif(
    not (sys.platform == "linux" and os.uname().machine == "x86_64"), reason="native frames: Linux x86-64 only"
)


def stacks(prof: Any, thread_name: str) -> list[tuple[list[dict[str, Any]], float]]:
    """The stacks (frames root first, as speedscope gives them) of one thread, with their seconds."""
    doc = prof.speedscope()
    frames = doc["shared"]["frames"]
    out = []
    for p in doc["profiles"]:
        if thread_name in p["name"]:
            out += [([frames[i] for i in s], w) for s, w in zip(p["samples"], p["weights"])]
    return out


def native_frames(stack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in stack if "line" not in f and ".so" in f.get("file", "")]


def record(target: Callable[[threading.Event], None], name: str, done: Callable[[Sampler], bool], **options: Any):
    s = Sampler(native=True, rate=200, **{"cpu_budget": 0.5, **options})
    s.start()
    try:
        with Threads((name, target, ())):
            wait_for(lambda: done(s))
    finally:
        s.stop()
    return s, s.profile()


def merged_at_least(n: int) -> Callable[[Sampler], bool]:
    return lambda s: s.stats()["native"]["merged"] >= n


def matmul_loop(stop: threading.Event) -> None:
    import numpy as np

    a = np.random.default_rng(0).random((256, 256))
    while not stop.is_set():
        a @ a


def test_numpy_matmul_shows_blas_under_the_python_line():
    s, prof = record(matmul_loop, "matmul", merged_at_least(50))
    assert prof.has_native
    gemm = [(st, w) for st, w in stacks(prof, "matmul") if any("gemm" in f["name"] for f in native_frames(st))]
    assert gemm, "no BLAS gemm frame in any sample"
    for st, _ in gemm:
        names = [f["name"] for f in st]
        caller = names.index("matmul_loop")
        first_gemm = next(i for i, n in enumerate(names) if "gemm" in n)
        assert caller < first_gemm, names
        assert all(f.get("file") and "line" not in f for f in st[caller + 1 :]), "only native frames below the caller"
    stats = s.stats()["native"]
    assert stats["off"] is None and stats["modules"]["symbols"] > 0
    # OpenBLAS's kernels are assembly without unwind information, which realigns its
    # stack: unwinding stops there unless the stack is scanned past it.
    assert stats["mismatched"] <= stats["captures"] // 10, stats
    # By time, not by distinct stacks: numpy's own calls around gemm (allocation, the
    # ufunc's set-up) are few samples but many stacks.
    with_native = sum(w for st, w in stacks(prof, "matmul") if native_frames(st))
    assert sum(w for _, w in gemm) >= 0.8 * with_native, (sum(w for _, w in gemm), with_native)


def sort_loop(stop: threading.Event) -> None:
    import numpy as np

    a = np.random.default_rng(0).random(1_000_000)
    b = np.empty_like(a)
    while not stop.is_set():
        b[:] = a  # a copy, then the sort, each on its own line (np.sort does both in one)
        b.sort()  # in this thread (a matmul waits for BLAS's own threads much of the time)


SORT_LINE = sort_loop.__code__.co_firstlineno + inspect.getsource(sort_loop).splitlines().index(
    "        b.sort()  # in this thread (a matmul waits for BLAS's own threads much of the time)"
)


def on_sort_line(s: Sampler, prof: Any) -> list[tuple[list[dict[str, Any]], float]]:
    """The sorting thread's samples on `sort_loop`'s sorting line. On py-spy's reader
    (3.9, 3.10) no capture teaches a line, so a sample without a capture of its own
    has no native frames: there, only those with."""
    pyspy = s.stats()["reader"] == "pyspy"
    return [(st, w) for st, w in stacks(prof, "sort") if sorting(st) and (native_frames(st) or not pyspy)]


def sorting(stack: list[dict[str, Any]]) -> bool:
    python = [f for f in stack if "line" in f]
    return bool(python) and python[-1]["name"] == "sort_loop" and python[-1]["line"] == SORT_LINE


def sort_kernel(stack: list[dict[str, Any]]) -> bool:
    return any("_multiarray_umath" in f["file"] and "sort" in f["name"].lower() for f in native_frames(stack))


def test_numpy_sort_unwinds_through_its_realigned_kernel():
    """numpy's SIMD sort (AVX2 and AVX-512 builds alike) realigns its stack, and its
    unwind tables find the caller's stack pointer by reading memory: unwound past it,
    the stack reaches the eval loop, so captures merge rather than being lent."""
    s, prof = record(sort_loop, "sort", merged_at_least(100))
    stats = s.stats()["native"]
    assert stats["modules"]["realigned"] > 0, stats["modules"]
    assert stats["mismatched"] <= stats["captures"] // 10, stats
    on_line = on_sort_line(s, prof)
    for st, _ in on_line:
        native = [i for i, f in enumerate(st) if f in native_frames(st)]
        assert not native or [f["name"] for f in st].index("sort_loop") < min(native), st
    kernel = sum(w for st, w in on_line if sort_kernel(st))
    assert kernel >= 0.8 * sum(w for _, w in on_line), (kernel, sum(w for _, w in on_line))


def test_a_budget_too_small_to_unwind_every_capture_lends_native_frames_instead():
    """Native frames cost captures before they cost rate: past what the budget leaves a
    tick, a capture is left unread (`spared`) and its sample is lent the native frames
    its lines last ran in, numpy's sort kernel under the sorting line. On py-spy's
    reader (3.9, 3.10) no capture teaches an innermost line, so none is spared; at 0.5%
    that reader ran at 1-5 Hz on an Intel Xeon VM (its first ticks are repaid for
    seconds), too few to merge 100 captures within the wait: it gets 2% (~40 Hz)."""

    def spared(s: Sampler) -> bool:
        native = s.stats()["native"]
        return native["merged"] >= 100 and (native["spared"] >= 30 or s.stats()["reader"] == "pyspy")

    s, prof = record(sort_loop, "sort", spared, cpu_budget=0.005 if FAST_WORKS else 0.02)
    stats = s.stats()["native"]
    assert stats["lent"] >= stats["spared"], stats
    if s.stats()["reader"] == "pyspy":
        assert stats["spared"] == 0, stats
    on_line = on_sort_line(s, prof)
    kernel = sum(w for st, w in on_line if sort_kernel(st))
    assert kernel >= 0.8 * sum(w for _, w in on_line), (kernel, sum(w for _, w in on_line))
    samples = stacks(prof, "sort")
    with_native = sum(w for st, w in samples if native_frames(st))
    assert with_native >= 0.5 * sum(w for _, w in samples), (with_native, sum(w for _, w in samples))


# CPU-time timers fire on the kernel's tick (4 ms at HZ=250): a 2 ms + 2 ms cycle was
# sampled in one phase only, all native or all callback. 1.3 + 2 ms drifts across it.
def python_callback() -> None:
    end = time.perf_counter() + 0.0013
    while time.perf_counter() < end:
        pass


def calls_native(stop: threading.Event) -> None:
    while not stop.is_set():
        _native._testing.native_caller(20, 0.002, python_callback)


def test_python_native_python_reads_in_order():
    """Python -> our extension's code -> Python: the native frames between, in order.
    (Named by function where the build keeps its symbols; a wheel's are stripped.) A
    Python read that tears as the thread enters the callback can, rarely, miss the
    entry frame between the two Python frames: a few such samples are allowed."""
    _, prof = record(calls_native, "caller", merged_at_least(200))
    in_order, out_of_order, spinning = 0, [], 0
    for st, _ in stacks(prof, "caller"):
        names = [f["name"] for f in st]
        if not native_frames(st):
            continue  # a Python-only sample: its halves disagreed
        inner = st[names.index("calls_native") + 1 :]
        if "python_callback" in names:
            middle = inner[: inner.index(next(f for f in inner if f["name"] == "python_callback"))]
            ours = (
                middle and all(f in native_frames(st) for f in middle) and any("_native" in f["file"] for f in middle)
            )
            in_order += bool(ours)
            if not ours:
                out_of_order.append(names)
        else:
            spinning += 1
            assert inner and all(f in native_frames(st) for f in inner), names
            assert any("_native" in f["file"] for f in inner), names
    assert spinning > 0 and in_order > 0
    assert len(out_of_order) <= max(1, (in_order + len(out_of_order)) // 20), out_of_order[:3]


def python_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def alternates(stop: threading.Event) -> None:
    """Native code and a Python function in turn, both called from one frame: a read of
    the Python frames and a signal a few microseconds apart often fall on either side."""
    while not stop.is_set():
        _native._testing.native_caller(1, 0.0002, int)
        python_for(0.0002)


def test_halves_of_two_moments_are_not_merged():
    """The thread returns from a Python function and calls native code between its
    Python read and its signal: the native callee must not be shown under the Python
    function it returned from (the two are one run of the eval loop, so counting
    eval loops cannot tell)."""
    s, prof = record(alternates, "alternates", merged_at_least(200))
    crossed, native_spins = [], 0
    for st, _ in stacks(prof, "alternates"):
        names = [f["name"] for f in st]
        ours = [i for i, f in enumerate(st) if f in native_frames(st) and "_native" in f["file"]]
        if ours:
            native_spins += 1
            if any(n in ("python_for", "Event.is_set") for n in names[: ours[-1]]):
                crossed.append(names)
    assert native_spins > 0
    assert not crossed, crossed[:3]
    # Our reader walks the frames each signal copied (one instant), or else saw halves of
    # two moments; py-spy's (3.9, 3.10) gives no frame pointer, and there a Python call runs
    # its own eval loop.
    native = s.stats()["native"]
    assert native["exact"] > 0 or native["moved"] > 0 or s.stats()["reader"] == "pyspy"


def test_captures_merge_with_the_python_frames_they_copied():
    """The same thread: a Python read at the tick would often fall on the other side of
    a call than its signal (`moved`, Python frames only). Walked from the frames the
    signal copied, the halves are of one instant and nearly every capture merges."""
    s, _ = record(alternates, "alternates", merged_at_least(200))
    stats = s.stats()
    native = stats["native"]
    if stats["reader"] == "pyspy":
        assert native["exact"] == 0  # py-spy's reader (3.9, 3.10) walks no copy
        return
    assert native["exact"] >= 0.9 * native["captures"], native
    # A capture the sampler took up late (a loaded machine) is not walked: it stands only
    # where its frame pointer still does, else it is `moved` and keeps its Python frames.
    # That is right; halves that disagree are not.
    assert native["mismatched"] <= max(5, native["captures"] // 40), native


def lent_and_merged(lent: int, merged: int) -> Callable[[Sampler], bool]:
    def done(s: Sampler) -> bool:
        native = s.stats()["native"]
        return native["lent"] >= lent and native["merged"] >= merged

    return done


def test_a_thread_short_of_cpu_keeps_native_frames_between_its_captures():
    """Beside 3 BLAS threads on 2 cores, the thread calling Python from native code is
    captured at fewer ticks than it is sampled on a CPU, often in the other phase than the
    tick reads it in. Such a sample is lent the native frames its Python lines last ran
    in (`lent`): before held captures, it kept its Python frames only, a sixth of them
    here (a Python callback with no native caller)."""
    stop = threading.Event()
    blas = [threading.Thread(target=matmul_loop, args=(stop,), daemon=True) for _ in range(3)]
    for t in blas:
        t.start()
    try:
        s, prof = record(calls_native, "caller", lent_and_merged(20, 300))
    finally:
        stop.set()
        for t in blas:
            t.join()
    if s.stats()["reader"] == "pyspy":
        # py-spy's reader (3.9, 3.10) gives no frame pointer to walk a signal's copy from:
        # its captures merge with the tick's frames, and a fifth of them disagree here.
        return
    samples = stacks(prof, "caller")
    with_native = sum(w for st, w in samples if native_frames(st))
    # 0.97-0.98 here alone, lent; 0.83-0.87 alone before captures stood for their thread.
    assert with_native >= 0.8 * sum(w for _, w in samples), (with_native, s.stats()["native"])


def even_caller(f: Callable[[], None]) -> None:
    f()


def odd_caller(f: Callable[[], None]) -> None:
    f()


def churns_code(stop: threading.Event) -> None:
    """Functions made by exec, each called once (native code, then back) and freed:
    their code objects' addresses are reused. The i-th is called by `even_caller` or
    `odd_caller` as i is even or odd, so a frame named from the code object that held
    its address before shows under the wrong caller. Each runs 20 ms of native code: a
    sample is lent its native frames only where the tick reads it in the call a capture
    of it taught (a function called once teaches no other)."""
    i = 0
    while not stop.is_set():
        namespace: dict = {"native": _native._testing.native_caller}
        exec(f"def churned_{i:05d}():\n    native(1, 0.02, int)\n", namespace)
        (odd_caller if i % 2 else even_caller)(namespace[f"churned_{i:05d}"])
        namespace.clear()  # breaks the function <-> globals cycle: freed now, not at gc
        python_for(0.003)
        i += 1


@pytest.mark.skipif(FREE_THREADED, reason="free-threaded builds (mimalloc) reused no freed code object's address here")
def test_frames_copied_by_a_signal_are_never_named_from_a_reused_address():
    """A signal copies a churned function's frame; by the tick its code object may be
    freed and another at its address, or the tick never read it and the cache still
    holds the one before at that address (3.12+ log no frees): the frame must read as
    the function that ran, or not be merged at all."""
    s, prof = record(churns_code, "churner", merged_at_least(150))
    named, wrong = 0, []
    for st, _ in stacks(prof, "churner"):
        names = [f["name"] for f in st]
        churned = [n for n in names if n.startswith("churned_")]
        caller = next((n for n in names if n in ("even_caller", "odd_caller")), None)
        if churned and caller and native_frames(st):
            named += 1
            if (int(churned[0][-5:]) % 2 == 1) != (caller == "odd_caller"):
                wrong.append(names)
    assert named > 0, "no churned function's frame merged with its native frames"
    assert not wrong, wrong[:3]
    if s.stats()["reader"] == "fast":
        assert s.stats()["reader_stats"]["code_objects_reused"] > 0, "no address was reused: the test proves nothing"


def arrow_sort(values: Any) -> Callable[[threading.Event], None]:
    import pyarrow.compute as pc

    def sort(stop: threading.Event) -> None:
        while not stop.is_set():
            pc.sort_indices(values)

    return sort


def test_pyarrow_names_are_demangled():
    import pyarrow as pa

    # Imported and built before sampling: the samples waited for are the sort's, not
    # the import's (slower while allocations are tracked).
    values = pa.array(list(range(200_000))[::-1])
    _, prof = record(arrow_sort(values), "arrow", merged_at_least(50))
    names = {f["name"] for st, _ in stacks(prof, "arrow") for f in native_frames(st)}
    assert any(n.startswith("arrow::") for n in names), sorted(names)[:20]
    raw = [n for n in names if n.startswith("_Z")]
    assert len(raw) <= len(names) // 10, raw


libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Sleeper:
    """A thread body sleeping in nanosleep through ctypes (C code that does not retry on
    EINTR), after `work_s` of Python between sleeps; counts its sleeps and interruptions."""

    def __init__(self, sleep_s: float, work_s: float = 0.0) -> None:
        self.sleep_ns, self.work_s = int(sleep_s * 1e9), work_s
        self.sleeps = 0
        self.interrupted: list[int] = []

    def __call__(self, stop: threading.Event) -> None:
        ts = Timespec(0, self.sleep_ns)
        while not stop.is_set():
            python_for(self.work_s)
            if libc.nanosleep(ctypes.byref(ts), None) != 0:
                self.interrupted.append(ctypes.get_errno())
            self.sleeps += 1


def test_sleeping_threads_are_never_interrupted():
    """A thread sleeping beside busy sampled threads is never signalled: it is in a
    system call."""
    sleeper = Sleeper(0.003)
    s = Sampler(native=True, rate=200, cpu_budget=0.5, idle=True)
    s.start()
    try:
        with Threads(("busy", matmul_loop, ()), ("sleeper", sleeper, ())):
            wait_for(lambda: sleeper.sleeps >= 1000 and s.stats()["native"]["merged"] >= 100)
    finally:
        s.stop()
    assert sleeper.interrupted == [], f"{len(sleeper.interrupted)} of {sleeper.sleeps} sleeps interrupted"


def test_a_thread_seen_sleeping_gets_no_timer():
    """A timer on a thread's CPU clock fires only while the thread runs, but it can fire
    as the thread enters a sleep, which then ends with EINTR (C code may not retry): a
    thread seen in a sleep lately is not armed, however much it computes between."""
    sleeper = Sleeper(0.001, work_s=0.001)
    # Its samples on a CPU, once it was seen asleep, count in `not_signalled` (a thread
    # signalled until then may have been captured: other threads can be too).
    record(
        sleeper,
        "sleeper",
        lambda s: sleeper.sleeps >= 3000 and s.stats()["native"]["not_signalled"] >= 50,
        idle=True,
    )
    assert sleeper.interrupted == [], f"{len(sleeper.interrupted)} of {sleeper.sleeps} sleeps interrupted"


def test_a_thread_blocking_the_signal_gets_python_only_samples():
    probe = Sampler(native=True)
    probe.start()
    sig = probe.stats()["native"]["signal"]
    probe.stop()

    def blocked(stop: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
        while not stop.is_set():
            sum(range(1000))

    s, prof = record(blocked, "blocked", lambda s: s.stats()["native"]["no_capture"] >= 20)
    samples = stacks(prof, "blocked")
    assert samples and not any(native_frames(st) for st, _ in samples)
    stats = s.stats()["native"]
    assert stats["captures"] == 0 and stats["off"] is None


def test_the_applications_handler_wins():
    # One the application set before: never replaced, another signal is used.
    top = signal.SIGRTMAX
    got: list[int] = []
    signal.signal(top, lambda n, f: got.append(n))
    try:
        s, _ = record(matmul_loop, "matmul", merged_at_least(5))
        used = s.stats()["native"]["signal"]
        assert used != top
        assert signal.getsignal(top) is not signal.SIG_DFL
        signal.pthread_kill(threading.get_ident(), top)
        wait_for(lambda: got == [top])
        # One the application sets while sampling: native capture stops, with the reason.
        s = Sampler(native=True, rate=200, cpu_budget=0.5)
        s.start()
        sig = s.stats()["native"]["signal"]
        try:
            with Threads(("matmul", matmul_loop, ())):
                wait_for(lambda: s.stats()["native"]["merged"] >= 5)
                signal.signal(sig, lambda n, f: got.append(n))
                wait_for(lambda: s.stats()["native"]["off"])
                assert f"signal {sig}" in s.stats()["native"]["off"]
                signal.pthread_kill(threading.get_ident(), sig)
                # One of ours sent just before the handler changed may reach it too.
                wait_for(lambda: sig in got)
                assert got[0] == top and set(got) == {top, sig}
                assert s.is_running
        finally:
            s.stop()
            signal.signal(sig, signal.SIG_DFL)
    finally:
        signal.signal(top, signal.SIG_DFL)


PENDING_AT_STOP = textwrap.dedent(
    """
    import signal, threading
    from dask_pyspy import Sampler

    def pending(sig):
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            line = next(l for l in f if l.startswith("SigPnd:"))
        return int(line.split()[1], 16) >> (sig - 1) & 1

    s = Sampler(native=True, rate=200, cpu_budget=0.5)
    s.start()
    sig = s.stats()["native"]["signal"]
    stopped, result = threading.Event(), []

    def busy():
        # The timer's signal waits, blocked, until the sampler has stopped.
        signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
        while not pending(sig):
            sum(range(1000))
        result.append("pending")
        stopped.wait()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        result.append("delivered")

    t = threading.Thread(target=busy)
    t.start()
    while not result:
        t.join(0.01)
    s.stop()
    stopped.set()
    t.join()
    again = Sampler(native=True, rate=200, cpu_budget=0.5)
    again.start()
    again.stop()
    assert again.stats()["native"]["off"] is None, again.stats()["native"]
    print("OK", result)
    """
)


def test_a_signal_pending_when_the_sampler_stops_never_ends_the_process():
    """A timer's signal can still be pending after its timer is deleted (before Linux
    6.13, which drops such a signal): restoring the default disposition, which ends
    the process for a real-time signal, would let it kill a worker."""
    done = subprocess.run([sys.executable, "-c", PENDING_AT_STOP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.strip() == "OK ['pending', 'delivered']", done.stdout


def test_one_process_one_native_sampler():
    a = Sampler(native=True)
    b = Sampler(native=True)
    a.start()
    b.start()
    try:
        assert "another sampler" in b.stats()["native"]["off"]
        assert a.stats()["native"]["off"] is None
    finally:
        a.stop()
        b.stop()


CHURN = textwrap.dedent(
    """
    import ctypes, os, threading, time
    from dask_pyspy import Sampler
    import numpy as np

    s = Sampler(native=True, rate=500, cpu_budget=1.0)
    s.start()
    a = np.ones((64, 64))

    def short():
        for _ in range(20):
            a @ a

    # Thread churn: 1,000 short threads.
    for _ in range(50):
        ts = [threading.Thread(target=short) for _ in range(20)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    # Imports and dlopen/dlclose while sampling.
    for _ in range(200):
        lib = ctypes.CDLL("libm.so.6")
        lib.cos.restype = ctypes.c_double
        lib.cos(ctypes.c_double(1.0))
        ctypes._dlclose(lib._handle) if hasattr(ctypes, "_dlclose") else None
    import decimal, json, sqlite3  # noqa: F401
    # Deep C recursion: a deep Python -> C -> Python chain through functools.reduce.
    import functools, sys
    sys.setrecursionlimit(10_000)
    def deep(n):
        return 0 if n == 0 else functools.reduce(lambda x, y: deep(n - 1), [0, 1])
    end = time.time() + 2
    while time.time() < end:
        deep(300)
    # Fork: the child starts clean, with its own native capture.
    pid = os.fork()
    if pid == 0:
        c = Sampler(native=True, rate=200, cpu_budget=0.5)
        c.start()
        end = time.time() + 30
        while time.time() < end and c.stats()["native"]["merged"] < 5:
            a @ a
        ok = c.stats()["native"]["merged"] >= 5 and c.stats()["native"]["off"] is None
        c.stop()
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    s.stop()
    st = s.stats()["native"]
    assert st["merged"] > 0 and st["off"] is None, st
    print("OK", st["captures"], st["merged"], st["mismatched"], st["modules"]["listings"])
    """
)


def test_no_crash_under_churn_dlopen_deep_recursion_and_fork():
    done = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("OK"), done.stdout


CPP_EXCEPTIONS = textwrap.dedent(
    """
    import threading, time
    import pyarrow as pa
    from dask_pyspy import Sampler

    s = Sampler(native=True, rate=500, cpu_budget=1.0)
    s.start()
    # C++ exceptions thrown in a loop: arrow raises one for every invalid cast.
    bad = pa.array(["x"] * 100)
    end = time.time() + 5
    caught = 0
    while time.time() < end:
        try:
            bad.cast(pa.int64())
        except pa.ArrowInvalid:
            caught += 1
    s.stop()
    assert caught > 100 and s.stats()["native"]["captures"] > 0, (caught, s.stats()["native"])
    print("OK", caught)
    """
)


def test_cpp_exceptions_while_sampling():
    done = subprocess.run([sys.executable, "-c", CPP_EXCEPTIONS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("OK"), done.stdout


PAGE = 4096

BUSY_C = """
#include <time.h>
volatile double sink;
__attribute__((noinline)) void PREFIX_spin(double seconds) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        for (int i = 0; i < 100000; i++) sink += i * 0.5;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
}
"""


def busy_library(directory: Any, prefix: str = "busy", fillers: int = 300) -> str:
    """`libbusy.so` in `directory`: `{prefix}_spin` (a busy loop) and `fillers` functions
    named after `prefix`, which with the debug information put the symbol and string tables
    pages past the segments the loader maps. Frame pointers: its frames unwind without
    its tables."""
    os.makedirs(directory, exist_ok=True)
    source, path = os.path.join(directory, "busy.c"), os.path.join(directory, "libbusy.so")
    fill = "".join(
        f"int {prefix}_filler_{i:03d}_with_a_long_name(int x) {{ return x * {i} + 1; }}\n" for i in range(fillers)
    )
    with open(source, "w") as f:
        f.write(BUSY_C.replace("PREFIX", prefix) + fill)
    cc = ["cc", "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer", "-o", path, source]
    subprocess.run(cc, check=True, capture_output=True, timeout=120)
    return path


def layout(path: str) -> tuple[int, int]:
    """Where the file's last loaded segment ends, and where its string table (`.strtab`) starts."""
    with open(path, "rb") as f:
        data = f.read()
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", data, 54)
    segments = [struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize) for i in range(phnum)]
    end = max(offset + filesz for kind, _, offset, _, _, filesz in segments if kind == 1)  # PT_LOAD
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    strtab = next(s[4] for s in sections if data[names + s[0] : data.index(b"\0", names + s[0])] == b".strtab")
    return end, strtab


LIBRARY_CHANGED = textwrap.dedent(
    """
    import ctypes, json, os, sys, threading, time
    from dask_pyspy import Sampler

    path, change, arg = sys.argv[1:4]
    lib = ctypes.CDLL(path)
    lib.busy_spin.argtypes = [ctypes.c_double]
    if change == "replace":
        os.replace(arg, path)  # a new inode at the path, before the sampler ever saw it
    s = Sampler(native=True, rate=200, cpu_budget=0.5)
    s.start()  # lists the modules (which the sampler once mapped, whole) before it returns
    if change == "cut":
        os.truncate(path, int(arg))
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            lib.busy_spin(0.05)

    t = threading.Thread(target=spin, name="spinner")
    t.start()
    names, deadline = [], time.monotonic() + 120
    while not (names and s.stats()["native"]["merged"] >= 20) and time.monotonic() < deadline:
        time.sleep(0.2)
        frames = s.profile().speedscope()["shared"]["frames"]
        names = sorted({f["name"] for f in frames if f.get("file") == "libbusy.so"})
    stop.set()
    t.join()
    s.stop()
    print(json.dumps({"names": names, "modules": s.stats()["native"]["modules"]}))
    """
)


def run_changed(path: str, change: str, arg: str) -> dict[str, Any]:
    """LIBRARY_CHANGED in a child, so that a fault shows as its signal rather than ending pytest."""
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY_CHANGED, path, change, arg], capture_output=True, text=True, timeout=300
    )
    died = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else done.returncode
    assert done.returncode == 0, (died, done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def nameless(names: list[str]) -> bool:
    return bool(names) and all(re.fullmatch(r"libbusy\.so\+0x[0-9a-f]+", n) for n in names)


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@needs_cc
def test_a_library_cut_while_loaded_never_faults(tmp_path):
    """A library's file truncated in place while loaded (`cp` over it, an NFS server's
    update): a mapping of it faults (SIGBUS) at any page past the new end, which killed
    the worker when the sampler mapped the file. Cut just past its loaded segments, its
    code runs on; its symbols are gone, so its frames read `libbusy.so+0x...`."""
    path = busy_library(tmp_path)
    end, strtab = layout(path)
    assert strtab >= (end // PAGE + 1) * PAGE, "the string table must lie in pages wholly past the cut"
    out = run_changed(path, "cut", str(end))
    assert nameless(out["names"]), out
    assert out["modules"]["unreadable"] + out["modules"]["replaced"] >= 1, out


@needs_cc
def test_a_library_replaced_on_disk_is_named_only_from_the_same_bytes(tmp_path):
    """A library's file replaced while loaded, before the sampler read it (a new inode at
    its path, as `pip install` leaves it): another build is not the code loaded, and its
    names would be wrong (a sampler that mapped it named `busy_spin` `_fini`); the same
    bytes (the same wheel installed again) still name it."""
    path = busy_library(tmp_path / "loaded")
    same = shutil.copy(path, tmp_path / "same.so")
    assert run_changed(path, "replace", str(same))["names"] == ["busy_spin"]
    other = busy_library(tmp_path / "other", prefix="decoy", fillers=100)
    out = run_changed(path, "replace", other)
    assert nameless(out["names"]), out
    assert out["modules"]["replaced"] >= 1, out


def test_live_dump_shows_native_frames():
    s = Sampler(native=True, rate=200, cpu_budget=0.5)
    s.start()

    def gemm_in_dump() -> bool:
        threads = [th for th in s.dump()["threads"] if th.get("name") == "matmul"]
        return any("gemm" in f["name"] and f["native"] for th in threads for f in th["frames"])

    try:
        with Threads(("matmul", matmul_loop, ())):
            wait_for(lambda: s.stats()["native"]["merged"] >= 5)
            wait_for(gemm_in_dump)
    finally:
        s.stop()


def test_python_only_leaves_the_native_frames_out():
    _, prof = record(matmul_loop, "matmul", merged_at_least(20))
    plain = prof.python_only()
    assert not plain.has_native
    assert plain.n_samples == prof.n_samples
    assert abs(plain.sampled_seconds - prof.sampled_seconds) < 1e-6
    assert not any(native_frames(st) for st, _ in stacks(plain, "matmul"))


def test_native_frames_in_exports():
    import gzip

    _, prof = record(matmul_loop, "matmul", merged_at_least(20))
    top = prof.summary()["top"]
    assert any(f["is_native"] and ".so" in f["file"] for f in top)
    svg = prof.flamegraph_svg("t")
    assert "gemm" in svg
    pprof = gzip.decompress(prof.to_pprof())
    assert b"libscipy_openblas" in pprof or b"openblas" in pprof


def test_bad_native_option_is_a_clear_error():
    with pytest.raises(ValueError, match="native"):
        Sampler(native="yes")
