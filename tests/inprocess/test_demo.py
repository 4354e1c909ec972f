"""The demo's cluster sizing: task threads that fit the cores beside the scheduler."""

from __future__ import annotations

import pytest

from dask_pyspy.demo import MAX_WORKERS, SCHEDULER_CORES, sized


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 5, 8, 16, 64, 256])
def test_task_threads_fit_beside_the_scheduler(cores):
    workers, threads = sized(cores)
    assert 1 <= workers <= MAX_WORKERS and threads >= 1
    assert workers * threads <= max(1, cores - SCHEDULER_CORES), (cores, workers, threads)
    assert workers * threads > cores - SCHEDULER_CORES - workers, "no core left unused that a thread more would fit"


def test_this_small_machine():
    assert sized(2) == (1, 1)
    assert sized(5) == (2, 2)


def test_a_given_count_stays_and_the_other_fills_the_rest():
    assert sized(9, workers=2) == (2, 4)
    assert sized(9, threads=4) == (2, 4)
    assert sized(2, workers=3, threads=5) == (3, 5)
    assert sized(2, workers=3) == (3, 1)
