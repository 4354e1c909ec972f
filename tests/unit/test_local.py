"""PySpyProfiler on dask's local schedulers."""

from __future__ import annotations


import dask
import pytest

from dask_pyspy import PySpyProfiler
from tests.integration.workload import alpha, beta


@dask.delayed
def run_alpha(i):
    return alpha(i, 0.01)


@dask.delayed
def run_beta(i):
    return beta(i, 0.01)


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_tasks_tagged_on_local_schedulers(scheduler):
    work = [run_alpha(i) for i in range(60)] + [run_beta(i) for i in range(60)]
    with PySpyProfiler(rate=200, cpu_budget=0.3) as prof:
        dask.compute(work, scheduler=scheduler, num_workers=2)
    summary = prof.profile.summary()
    prefixes = {p["prefix"]: p for p in summary["prefixes"]}
    assert {"run_alpha", "run_beta"} <= set(prefixes)
    doc = prof.profile.speedscope(by="prefix")
    frames = doc["shared"]["frames"]
    wrong = right = 0.0
    for p in doc["profiles"]:
        for sample, weight in zip(p["samples"], p["weights"]):
            names = [frames[i]["name"] for i in sample]
            if frames[sample[0]].get("file") == "dask task" and {"alpha", "beta"} & set(names):
                expect = "alpha" if names[0] == "run_alpha" else "beta"
                right += weight * (expect in names)
                wrong += weight * (expect not in names)
    # 120 tasks of 10 ms: most of their 1.2 s is tagged, and tagged right.
    assert right > 0.5 and wrong <= 0.01 * (right + wrong), (right, wrong)


def test_profile_before_compute_is_an_error():
    prof = PySpyProfiler()
    with pytest.raises(RuntimeError, match="nothing was computed"):
        prof.profile
