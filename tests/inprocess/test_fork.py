"""fork() with a sampler running: the child starts over, stopped, empty and startable,
without a Rust panic; the parent samples on. Each case runs in its own interpreter so
its stderr (where a panic would print) can be read, and a hang cannot take pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import os, sys, threading, time
from dask_pyspy import Sampler, _native, config
from dask_pyspy.sampler import process_sampler
from tests.conftest import wait_for

def spin_until_sampled(s):
    # This thread spins (so it is on a CPU when read) until the sampler kept some of it.
    deadline = time.monotonic() + 60
    while s.profile().n_samples < 5:
        assert time.monotonic() < deadline, "no samples in 60 s"
        sum(range(20_000))

def ticks(s):
    return s.stats()["ticks"]
"""


def run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "panic" not in done.stderr.lower(), done.stderr
    return done


def test_a_forked_child_starts_clean_and_can_sample_again():
    done = run("""
        s = Sampler(rate=200, cpu_budget=1.0)
        s.start()
        spin_until_sampled(s)
        copied = _native.Sampler()
        copied.start()
        pid = os.fork()
        if pid == 0:
            # Not running, no samples, nothing started: a profile says so.
            assert not s.is_running and s.stats()["ticks"] == 0 and s.stats()["store"]["samples_held"] == 0
            try:
                s.profile()
                raise AssertionError("a child's profile must not hold the parent's samples")
            except RuntimeError as e:
                assert "never started" in str(e)
            s.stop()
            s.start()
            assert s.is_running
            spin_until_sampled(s)
            assert {p["pid"] for p in s.profile().processes} == {os.getpid()}
            s.stop()
            assert not s.is_running
            # A native sampler nobody reset is a dead copy: stopped, and it says why it cannot start.
            assert not copied.is_running
            copied.stop()
            try:
                copied.start()
                raise AssertionError("a forked copy must not start")
            except RuntimeError as e:
                assert "forked child" in str(e)
            sys.exit(0)  # a normal exit: finalizers run and drop the samplers
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert s.is_running, "the parent samples on"
        before = ticks(s)
        wait_for(lambda: ticks(s) > before)
        s.stop()
        copied.stop()
        print("ok")
    """)
    assert done.stdout.split() == ["ok"]


def test_the_process_sampler_is_free_in_the_child():
    """The plugin's shared sampler: its lock and user count start over in the child."""
    run("""
        sampler = process_sampler.acquire(config.sampler_options(rate=200))
        pid = os.fork()
        if pid == 0:
            assert process_sampler.sampler is sampler and not sampler.is_running
            assert process_sampler.acquire(config.sampler_options(rate=200)).is_running
            process_sampler.release()
            assert not sampler.is_running
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert sampler.is_running
        process_sampler.release()
    """)


def test_a_fork_pool_used_while_sampling():
    """Tasks that use multiprocessing with fork: the pool's children work and exit cleanly."""
    done = run("""
        import multiprocessing

        s = Sampler(rate=200, cpu_budget=1.0)

        def task(i):
            running_at_fork = s.is_running
            s.start()
            spin_until_sampled(s)
            s.stop()
            return i * i, running_at_fork, os.getpid()

        s.start()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            results = pool.map(task, range(8))
        assert [r[0] for r in results] == [i * i for i in range(8)]
        assert not any(r[1] for r in results), "no child believed it sampled"
        assert os.getpid() not in {r[2] for r in results}
        assert s.is_running
        before = ticks(s)
        wait_for(lambda: ticks(s) > before)
        s.stop()
        print("ok")
    """)
    assert done.stdout.split() == ["ok"]


def test_many_forks_while_the_sampler_ticks_fast_and_a_thread_reads_its_store():
    """Forks land while the sampling thread sleeps, ticks or waits for a lock: no child
    may hang or crash on a lock or a table of waiting threads its parent left behind."""
    run("""
        s = Sampler(rate=1000, cpu_budget=1.0)
        s.start()
        stop = threading.Event()

        def read_store():
            while not stop.is_set():
                s.profile(start=time.time() - 0.05)

        reader = threading.Thread(target=read_store)
        reader.start()
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                s.start()
                wait_for(lambda: ticks(s) >= 3)
                s.stop()
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        stop.set()
        reader.join()
        assert s.is_running
        s.stop()
    """)
