"""A process returns to its descriptor and thread counts once our servers end, however
they end, and a thread's files go with the thread (see `traces.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def scenario(name: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.cluster.traces", name], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("end", ["close", "stop"])
def test_a_preloaded_server_leaves_nothing_behind(end):
    out = scenario(end)
    during = out["during"]
    assert during["sampling"]["running"]
    assert during["sampling"]["syscall_files"] > 0 and during["thread_files"] > 0, "the sampler read a thread's state"
    assert during["processes_profiled"] >= 1, "a collection ran in our job threads"
    # Beyond what distributed's own servers leave (a stopped scheduler keeps a descriptor):
    assert out["after"] == out["expected"], out
    assert not out["sampler_running"], "stopping the scheduler released the sampler"
    assert out["thread_files_after"] == []
    assert not [t for t in out["threads_after"] if t.startswith("pyspy")], out["threads_after"]


def test_a_worker_leaves_a_running_sampler_as_it_found_it():
    out = scenario("worker")
    assert out["during"]["fds"] > out["before"]["fds"]
    # Descriptors, as distributed's test counts them: threads a worker's first start
    # leaves (its libraries' pools on the oldest distributed) are not ours.
    assert out["after"]["fds"] == out["before"]["fds"], out
    assert not [t for t in out["threads_after"] if t.startswith("pyspy")], out


def test_a_thread_asleep_at_the_start_costs_no_descriptor_later():
    out = scenario("sleeper")
    assert out["samples"] > 0, "its work was sampled"
    assert out["after"] == out["before"], out


def test_a_threads_files_go_with_it():
    out = scenario("short-threads")
    assert out["peak_syscall_files"] > 10, "threads' files were open while they ran"
    assert out["after"] == out["before"], out
