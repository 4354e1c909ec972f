"""A minute at 1000 Hz over thread churn and ever-new task keys: bounded, flat, no errors."""

from __future__ import annotations

import itertools
import threading
import time

import psutil
import pytest

from dask_pyspy import Sampler

CAP = 2 * 2**20


def churn(sampler: Sampler, stop: threading.Event) -> None:
    keys = itertools.count()

    def short_life() -> None:
        ident = threading.get_ident()
        for _ in range(3):
            sampler.set_thread_tag(ident, f"('soak-{next(keys)}', {next(keys)})", "soak")
            end = time.perf_counter() + 0.005
            while time.perf_counter() < end:
                sum(range(100))
            sampler.clear_thread_tag(ident)

    while not stop.is_set():
        batch = [threading.Thread(target=short_life, name=f"churn-{next(keys)}") for _ in range(4)]
        for t in batch:
            t.start()
        for t in batch:
            t.join()


@pytest.mark.slow  # a minute or more; ci/test.sh runs it, `-m 'not slow'` skips it
def test_soak_under_thread_churn():
    s = Sampler(rate=1000, idle=True, cpu_budget=1.0, max_memory=CAP)
    stop = threading.Event()
    worker = threading.Thread(target=churn, args=(s, stop))
    s.start()
    worker.start()
    rss = []
    try:
        # At least a minute, and on until the cap was reached and enforced (a busy
        # machine fills the store more slowly).
        deadline = time.monotonic() + 300
        while len(rss) < 6 or not s.stats()["store"]["compactions"]:
            assert time.monotonic() < deadline, s.stats()["store"]
            time.sleep(10)
            rss.append(psutil.Process().memory_info().rss / 2**20)
            assert s.is_running, s.stats()["panic"]
    finally:
        stop.set()
        worker.join()
        s.stop()
    stats = s.stats()
    store = stats["store"]
    assert store["bytes"] <= CAP
    reached = store["samples_folded"] + store["samples_evicted"] > 0  # past the cap the oldest fold, then go
    assert reached and store["compactions"] > 0, "the cap was reached and enforced"
    assert stats["panic"] is None
    assert stats["failed_ticks"] < 0.05 * stats["ticks"], stats["last_error"]
    reads = stats["reader_stats"]
    if stats["reader"] == "fast":
        assert reads["lost_reads"] < 0.05 * reads["thread_reads"], reads
    # After warm-up (the store fills in the first seconds) RSS stays flat.
    assert max(rss[1:]) - rss[1] < 16, rss
    prof = s.profile()
    assert prof.metadata["processes"][0]["stats"]["store"]["samples_evicted"] == store["samples_evicted"]
    assert prof.n_samples == store["samples_held"] + store["samples_folded"]
