"""The fast stack reader against its oracles: py-spy's reader and Python's own frames."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import select
import sys
import threading
import time

import pytest

from dask_pyspy import Sampler
from tests.conftest import FAST_WORKS, FREE_THREADED, frame_names, wait_for

needs_fast = pytest.mark.skipif(not FAST_WORKS, reason="the fast reader reads CPython 3.11+")


# Parked threads: each reaches a known stack and waits there until released.


def descend(n: int, ready, release) -> None:
    if n > 1:
        return descend(n - 1, ready, release)
    ready.release()
    release.wait()


def inner_gen(ready, release):
    ready.release()
    release.wait()
    yield 1


def outer_gen(ready, release):
    yield from inner_gen(ready, release)


def drive_generator(ready, release) -> None:
    for _ in outer_gen(ready, release):
        pass


async def inner_coro(ready, release) -> None:
    ready.release()
    release.wait()  # blocks the loop on purpose: coroutine frames stay on the stack


async def outer_coro(ready, release) -> None:
    await inner_coro(ready, release)


def run_loop(ready, release) -> None:
    asyncio.run(outer_coro(ready, release))


def pool_task(n: int, ready, release) -> None:
    descend(n, ready, release)


class Parked:
    """Threads parked at known stacks: depths 1-300 (300 spans several datastack
    chunks), a generator chain, coroutines on an asyncio loop thread, a thread pool."""

    def __init__(self) -> None:
        self.ready = threading.Semaphore(0)
        self.release = threading.Event()
        args = (self.ready, self.release)
        targets = [(descend, (n, *args)) for n in (1, 10, 100, 300)] + [(drive_generator, args), (run_loop, args)]
        self.threads = [threading.Thread(target=t, args=a, name=f"parked-{i}") for i, (t, a) in enumerate(targets)]
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="parked-pool")

    def __enter__(self) -> Parked:
        for t in self.threads:
            t.start()
        futures = [self.pool.submit(pool_task, n, self.ready, self.release) for n in (3, 30)]
        for _ in range(len(self.threads) + len(futures)):
            assert self.ready.acquire(timeout=60)
        self.idents = {t.ident for t in self.threads} | set(self.pool_idents())
        return self

    def pool_idents(self) -> list[int]:
        return [t.ident for t in threading.enumerate() if t.name.startswith("parked-pool")]

    def __exit__(self, *exc) -> None:
        self.release.set()
        for t in self.threads:
            t.join()
        self.pool.shutdown()


def python_stacks(idents: set[int]) -> dict[int, list[tuple[str, str, int]]]:
    """Innermost first, as Python itself reports them."""
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident in idents:
            stack = []
            while frame is not None:
                stack.append((frame.f_code.co_qualname, frame.f_code.co_filename, frame.f_lineno))
                frame = frame.f_back
            out[ident] = stack
    return out


def dumped_stacks(sampler: Sampler, idents: set[int]) -> dict[int, list[tuple[str, str, int]]]:
    return {
        t["ident"]: [(f["name"], f["file"], f["line"]) for f in t["frames"]]
        for t in sampler.dump()["threads"]
        if t["ident"] in idents
    }


@needs_fast
def test_readers_agree_with_each_other_and_with_python():
    # py-spy's reader does not read free-threaded builds: there Python is the only oracle.
    readers = ("fast",) if FREE_THREADED else ("fast", "pyspy")
    samplers = [Sampler(rate=50, idle=True, cpu_budget=1.0, reader=r) for r in readers]
    with Parked() as parked:
        for s in samplers:
            s.start()
        try:
            truth = python_stacks(parked.idents)
            assert len(truth) == 8 and max(len(s) for s in truth.values()) > 300
            for _ in range(10):
                for s in samplers:
                    assert dumped_stacks(s, parked.idents) == truth
        finally:
            for s in samplers:
                s.stop()
    # No torn-read count here: the main thread runs Python through the test and may tear;
    # a torn parked thread would already have failed the comparisons above.
    assert [s.stats()["reader"] for s in samplers] == list(readers)


def test_auto_reader_is_the_fast_one_where_it_works():
    s = Sampler(rate=100)
    s.start()
    try:
        wait_for(lambda: s.stats()["ticks"] > 5, what="ticks")
        stats = s.stats()
        assert s.dump()["reader"] == stats["reader"]
    finally:
        s.stop()
    if FAST_WORKS:
        assert stats["reader"] == "fast", stats["reader_stats"]
    else:
        assert stats["reader"] == "pyspy"
        assert f"CPython 3.{sys.version_info.minor}" in stats["reader_stats"]["fallback_reason"]
        # 3.9 and 3.10 have py-spy's reader by design: the report shows no error for it.
        assert stats["reader_stats"]["fallback_expected"] == (sys.version_info < (3, 11)), stats["reader_stats"]


def test_fast_reader_where_it_cannot_work_raises(monkeypatch):
    if FAST_WORKS:
        # Test switch: the self-check sees a wrong line, as with a layout it misreads.
        monkeypatch.setenv("DASK_PYSPY_TESTING", "break-self-check")
    s = Sampler(reader="fast")
    with pytest.raises(RuntimeError, match=rf"reader='fast' cannot be used: .*CPython 3\.{sys.version_info.minor}"):
        s.start()
    assert not s.is_running
    auto = Sampler(rate=100)
    if FREE_THREADED:  # no fallback there
        with pytest.raises(RuntimeError, match="no reader reads this interpreter: self-check failed.*free-threaded"):
            auto.start()
        return
    auto.start()
    try:
        stats = auto.stats()
        assert stats["reader"] == "pyspy"
        reason = stats["reader_stats"]["fallback_reason"]
        assert f"CPython 3.{sys.version_info.minor}" in reason
        if FAST_WORKS:
            assert "self-check failed" in reason and "frame 0 reads as" in reason
            assert not stats["reader_stats"]["fallback_expected"], "a failed self-check is an error"
    finally:
        auto.stop()


def test_bad_reader_is_refused():
    with pytest.raises(ValueError, match="reader must be one of 'auto', 'fast', 'pyspy', got 'nope'"):
        Sampler(reader="nope")


@needs_fast
@pytest.mark.skipif(FREE_THREADED, reason="free-threaded builds (mimalloc) reused no freed code object's address here")
def test_reused_code_addresses_never_show_the_old_name():
    """Code objects made by exec and freed right after: their addresses are reused,
    often with their strings' addresses. Each call runs under a task tag naming the
    function (a tag never spans a stack read it did not cover), so a sample whose
    stack names another churned function than its tag was misread."""
    s = Sampler(rate=1000, cpu_budget=1.0)
    s.start()
    ident = threading.get_ident()
    try:
        for i in range(150):
            namespace: dict = {}
            name = f"churned_{i:04d}"
            exec(f"def {name}(spin):\n    spin(0.02)\n", namespace)
            s.set_thread_tag(ident, name, "churned")
            namespace[name](spin)
            s.clear_thread_tag(ident)
            namespace.clear()  # breaks the function <-> globals cycle: freed now, not at gc
    finally:
        s.stop()
    doc = s.profile(by="task").speedscope()
    seconds = 0.0
    for profile in doc["profiles"]:
        for sample, weight in zip(profile["samples"], profile["weights"]):
            names = frame_names(doc, sample)
            churned = [n for n in names[1:] if n.startswith("churned_")]
            if churned and names[0].startswith("churned_"):
                assert churned == [names[0]], f"a sample tagged {names[0]} shows {churned}"
                seconds += weight
    assert seconds > 1.0, "most of the 3 s of churned calls were sampled"
    assert s.stats()["reader_stats"]["code_objects_reused"] > 0, "no address was reused: the test proves nothing"


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def sleeper(release) -> None:
    release.wait()


def lock_waiter(lock) -> None:
    lock.acquire()


def select_waiter(fd) -> None:
    select.select([fd], [], [])


def numpy_without_gil(release) -> None:
    import numpy as np

    a = np.random.default_rng(0).random((600, 600))
    while not release.is_set():
        a @ a  # BLAS runs without the GIL


@needs_fast
def test_waiting_threads_are_idle_and_numpy_is_on_cpu_without_the_gil():
    release = threading.Event()
    lock = threading.Lock()
    lock.acquire()
    r, w = os.pipe()
    select_thread = threading.Thread(target=select_waiter, args=(r,))
    waiting = [
        threading.Thread(target=sleeper, args=(release,)),
        threading.Thread(target=lock_waiter, args=(lock,)),
        select_thread,
    ]
    blas = threading.Thread(target=numpy_without_gil, args=(release,))
    s = Sampler(rate=100, cpu_budget=1.0)
    for t in [*waiting, blas]:
        t.start()
    for t in waiting:
        wait_for(
            lambda t=t: (
                python_stacks({t.ident}).get(t.ident, [("",)])[0][0].endswith("waiter")
                or python_stacks({t.ident})[t.ident][0][0] == "Condition.wait"
            ),
            what=f"{t.name} to wait",
        )
    s.start()
    seen_blas = []
    try:

        def blas_running_without_gil() -> bool:
            threads = {t["ident"]: t for t in s.dump()["threads"]}
            assert not any(threads[t.ident]["active"] for t in waiting if t.ident in threads), threads
            # Lock waits may read as waiting on native threads: OpenBLAS's work meanwhile.
            allowed = {"blocked", "native"}
            assert all(threads[t.ident]["state"] in allowed for t in waiting if t.ident in threads), threads
            if select_thread.ident in threads:
                assert threads[select_thread.ident]["state"] == "blocked", threads
            b = threads.get(blas.ident)
            seen_blas.append(bool(b and b["active"] and not b["owns_gil"] and b["state"] in ("cpu", "cpu-wait")))
            return sum(seen_blas) >= 3

        wait_for(blas_running_without_gil, what="the numpy thread on a CPU without the GIL")
    finally:
        release.set()
        lock.release()
        os.write(w, b"x")
        for t in [*waiting, blas]:
            t.join()
        s.stop()
        os.close(r)
        os.close(w)


def chain_a1() -> int:
    return chain_a2()


def chain_a2() -> int:
    return 1


def chain_b1() -> int:
    return chain_b2()


def chain_b2() -> int:
    return 2


def churn(stop: threading.Event) -> None:
    """Two call chains through the same frame slots, each a fraction of a microsecond."""
    while not stop.is_set():
        chain_a1()
        chain_b1()


@needs_fast
def test_churning_threads_are_read_whole_or_not_at_all():
    """A thread whose stack changes faster than it can be copied: its copies are read
    again in the same tick until two agree, so few reads are lost, kept samples name
    only the thread's own functions, and almost none mixes the two chains (a stale
    frame under a new caller: 0 to 0.04% measured on 3.11-3.15, where every copy of
    the same read tore alike)."""
    stop = threading.Event()
    threads = [threading.Thread(target=churn, args=(stop,), name=f"churn-{i}") for i in range(2)]
    for t in threads:
        t.start()
    s = Sampler(rate=500, cpu_budget=1.0)
    s.start()

    def churn_samples() -> int:
        # A loaded machine keeps the churning threads off a CPU (idle, unsampled) at times.
        doc = s.profile().speedscope()
        return sum(len(p["samples"]) for p in doc["profiles"] if " churn-" in p["name"])

    try:
        wait_for(lambda: churn_samples() > 500, timeout=120, what="500 samples of the churning threads")
    finally:
        s.stop()
        stop.set()
        for t in threads:
            t.join()
    doc = s.profile().speedscope()
    chains = [["chain_a1", "chain_a2"], ["chain_b1", "chain_b2"], ["Event.is_set"]]
    own = {name for chain in chains for name in chain}
    kept = mixed = 0
    for profile in doc["profiles"]:
        if " churn-" in profile["name"]:
            for sample in profile["samples"]:
                names = frame_names(doc, sample)
                below = names[names.index("churn") + 1 :]
                assert set(below) <= own, names
                kept += 1
                mixed += not any(below == chain[: len(below)] for chain in chains)
    reads = s.stats()["reader_stats"]
    assert kept > 500
    assert mixed <= 0.005 * kept, (mixed, kept)
    assert reads["lost_reads"] < 0.05 * reads["thread_reads"], reads
