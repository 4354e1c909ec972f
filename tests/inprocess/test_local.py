"""PySpyProfiler on dask's local schedulers."""

from __future__ import annotations

import re

import dask
import pytest

from dask_pyspy import PySpyProfiler
from tests.cluster.test_cluster import tagged_samples
from tests.cluster.workload import alpha, beta, gamma

FUNCTIONS = {"alpha", "beta", "gamma"}
# The pool's hand-off code, which tagging from submission to completion charged to tasks.
MACHINERY = {"Condition.notify", "Queue.put", "Future.set_result", "_worker"}


def short_tasks(n: int) -> list:
    """`n` tasks of ~1 ms for each function, interleaved, keys `alpha-<token>` etc."""
    return [dask.delayed(f, pure=False)(i, 0.001) for i in range(n) for f in (alpha, beta, gamma)]


def judged(doc: dict) -> list[bool]:
    """For each tagged sample running a task function: is it tagged with that function's prefix?"""
    return [{prefix} == FUNCTIONS & set(names) for prefix, names, _ in tagged_samples(doc) if FUNCTIONS & set(names)]


def prefix_rows(html: str) -> dict[str, dict[str, str]]:
    """The report's task prefix table: prefix -> {column header: cell text}."""
    table = next(t for t in re.findall(r"<table>.*?</table>", html, re.S) if "<th>task wall s</th>" in t)
    rows = [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)]
    return {row[0]: dict(zip(rows[0], row)) for row in rows[1:]}


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_short_tasks_tagged_with_their_own_prefix(scheduler):
    with PySpyProfiler(rate=500, cpu_budget=0.3) as prof:
        # Again until enough was sampled: a loaded machine may sample little of one round.
        rounds = 0
        while rounds < 10:
            rounds += 1
            dask.compute(short_tasks(300), scheduler=scheduler, num_workers=2)
            doc = prof.profile.speedscope(by="prefix")
            prefixes = {prefix for prefix, _, _ in tagged_samples(doc)}
            if FUNCTIONS <= prefixes and len(judged(doc)) >= 200:
                break
    doc = prof.profile.speedscope(by="prefix")
    right = judged(doc)
    assert FUNCTIONS <= {prefix for prefix, _, _ in tagged_samples(doc)}
    assert len(right) >= 200, "enough samples to judge"
    assert sum(right) >= 0.99 * len(right), f"{len(right) - sum(right)} of {len(right)} samples mislabelled"

    # Only the task's own call is tagged, not the pool's hand-off around it.
    tagged = tagged_samples(doc)
    handoff = sum(w for _, names, w in tagged if names[-1] in MACHINERY)
    assert handoff <= 0.01 * sum(w for _, _, w in tagged), handoff

    (tasks,) = prof.profile.metadata["tasks"].values()  # one process: this one
    for name in FUNCTIONS:
        assert tasks[name]["count"] == 300 * rounds
        assert tasks[name]["seconds"] >= 0.001 * 300 * rounds  # each spins >= 1 ms
    rows = prefix_rows(prof.profile.to_html())
    for name in FUNCTIONS:
        assert rows[name]["tasks"] == f"{300 * rounds:,}"
        assert float(rows[name]["task wall s"].replace(",", "")) >= 0.001 * 300 * rounds


def test_processes_scheduler_gets_plain_tasks():
    # Tagged tasks pickle as the user's own, so other processes need nothing of ours.
    work = [dask.delayed(alpha)(i, 0.001) for i in range(4)]
    with PySpyProfiler() as prof:
        assert dask.compute(work, scheduler="processes", num_workers=1) == ([0, 1, 2, 3],)
    assert prof.profile.metadata["tasks"] == {prof.profile.processes[0]["name"]: {}}


def test_profile_before_compute_is_an_error():
    prof = PySpyProfiler()
    with pytest.raises(RuntimeError, match="nothing was computed"):
        _ = prof.profile
