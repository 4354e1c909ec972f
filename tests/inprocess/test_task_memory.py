"""Memory tracking in one process: allocations from before the hooks, tracemalloc
stacked on ours, and threads allocating at once (free-threaded builds included)."""

from __future__ import annotations

import threading
import tracemalloc

import pytest

from dask_pyspy import Sampler
from tests.conftest import wait_for

MIB = 2**20


def by_prefix(sampler: Sampler) -> dict[str | None, dict[str, float]]:
    return {row["prefix"]: row for row in sampler.memory()["prefixes"]}


def test_blocks_from_before_the_hooks_are_freed_without_being_counted():
    before = [bytearray(MIB) for _ in range(200)]
    s = Sampler(memory=True)
    s.start()
    try:
        ident = threading.get_ident()
        s.set_thread_tag(ident, "free-old-1", "free-old")
        before.clear()  # freed through our hooks, never sampled
        s.clear_thread_tag(ident)
        counted = by_prefix(s)
        assert all(row["in_use"] >= 0 for row in counted.values()), counted
        assert counted.get("free-old", {}).get("allocated", 0) < 4 * MIB, counted
    finally:
        s.stop()


def test_tracemalloc_started_after_ours_sees_the_same_and_stops_cleanly():
    s = Sampler(memory=True)
    s.start()
    try:
        tracemalloc.start()
        ident = threading.get_ident()
        s.set_thread_tag(ident, "traced-1", "traced")
        blocks = [bytearray(MIB) for _ in range(300)]
        s.clear_thread_tag(ident)
        traced, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        ours = by_prefix(s)["traced"]["in_use"]
        assert abs(ours - traced) < 0.15 * traced, (ours, traced)
        del blocks
    finally:
        s.stop()


def test_threads_allocating_at_once_are_each_charged_their_own():
    s = Sampler(memory=True)
    s.start()
    kept: dict[int, list[bytearray]] = {}

    def work(i: int) -> None:
        ident = threading.get_ident()
        s.set_thread_tag(ident, f"t{i}-1", f"t{i}")
        kept[i] = [bytearray(MIB) for _ in range(50 * (i + 1))]
        for _ in range(200):
            churn = [bytes(1000) for _ in range(100)]
            del churn
        s.clear_thread_tag(ident)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counted = by_prefix(s)
        for i in range(4):
            expected = 50 * (i + 1) * MIB
            assert abs(counted[f"t{i}"]["in_use"] - expected) < 0.2 * expected, (i, counted[f"t{i}"])
    finally:
        s.stop()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_threads_allocate_runs_and_exits():
    import os
    import time

    s = Sampler(memory=True)
    s.start()
    stop = threading.Event()

    def allocate() -> None:
        while not stop.is_set():
            blocks = [bytearray(MIB) for _ in range(8)]
            del blocks

    busy = [threading.Thread(target=allocate) for _ in range(2)]
    for t in busy:
        t.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                blocks = [bytearray(MIB) for _ in range(64)]
                del blocks
                os._exit(0 if not Sampler().memory()["tracking"] else 3)
            deadline = time.monotonic() + 60
            while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
                assert time.monotonic() < deadline, "the forked child hung"
                time.sleep(0.01)
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        for t in busy:
            t.join()
        s.stop()


def test_numpy_buffers_go_through_our_handler_in_the_tasks_context_only():
    import contextvars

    import numpy as np

    get_handler_name = (np._core if hasattr(np, "_core") else np.core).multiarray.get_handler_name
    s = Sampler(memory=True)
    s.start()
    seen: dict[str, object] = {}

    def task() -> None:
        ident = threading.get_ident()
        s.set_thread_tag(ident, "arrays-1", "arrays")
        array = np.ones(200 * MIB // 8)
        seen["handler"] = get_handler_name(array)
        seen["held"] = by_prefix(s)["arrays"]["in_use"]
        del array
        s.clear_thread_tag(ident)

    try:
        worker = threading.Thread(target=lambda: contextvars.copy_context().run(task))
        worker.start()
        worker.join()
        arrays = by_prefix(s)["arrays"]
        assert seen["handler"] == "dask_pyspy", seen
        assert abs(seen["held"] - 200 * MIB) < 0.05 * 200 * MIB, seen
        assert arrays["in_use"] < MIB and abs(arrays["peak"] - 200 * MIB) < 0.05 * 200 * MIB, arrays
        elsewhere: list[str] = []
        other = threading.Thread(target=lambda: elsewhere.append(get_handler_name()))
        other.start()
        other.join()
        assert elsewhere != ["dask_pyspy"], "set in the task's context only"
    finally:
        s.stop()


def hold_strings(n: int) -> list[str]:
    return [str(i) * 100 for i in range(n)]


def hold_array(mib: int) -> object:
    import numpy as np

    return np.ones(mib * MIB // 8)


def named_sites(rows: list[dict], prefix: str | None = None) -> list[dict] | None:
    """The rows of `prefix` (None: every row) once the sampling thread has named each
    row's stack, else None."""
    rows = [row for row in rows if prefix is None or row["prefix"] == prefix]
    return None if any(row["note"] == "stack not named yet" for row in rows) else rows


def sites_of(sampler: Sampler, prefix: str) -> list[dict]:
    return wait_for(lambda: named_sites(sampler.memory()["sites"], prefix), "stacks named")


def test_blocks_in_use_are_charged_to_the_stack_that_allocated_them():
    s = Sampler(memory=True)
    s.start()
    try:
        ident = threading.get_ident()
        s.set_thread_tag(ident, "hold-1", "hold")
        kept = [hold_strings(300_000), hold_array(100)]
        s.clear_thread_tag(ident)
        sites = sites_of(s, "hold")
        in_use = by_prefix(s)["hold"]["in_use"]
        assert abs(sum(row["in_use"] for row in sites) - in_use) < 1, "every byte in use has one row"
        if s.stats()["reader"] != "fast":  # 3.9 and 3.10: py-spy's reader cannot name our stacks
            assert {row["note"] for row in sites} == {"no stack kept"}, sites
            return
        held_by = {}
        for row in sites:
            # 3.11 runs a list comprehension as a function of its own: `hold_strings.<locals>.<listcomp>`.
            functions = [f["name"].split(".")[0] for f in row["frames"] if f["file"] == __file__]
            held_by.setdefault(functions[-1] if functions else row["note"], []).append(row["in_use"])
        # 300,000 strings of 100-600 characters, and a 100 MiB array, each from its own function.
        strings, array = sum(held_by.get("hold_strings", [])), sum(held_by.get("hold_array", []))
        assert abs(array - 100 * MIB) < 0.05 * 100 * MIB, held_by
        assert strings > 0.8 * (in_use - array), held_by
        test = next(row for row in sites if row["frames"])["frames"]
        assert test[0]["file"] != __file__ and any(f["name"].startswith("test_blocks_in_use") for f in test), test
        del kept
    finally:
        s.stop()
