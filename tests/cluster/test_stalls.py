"""Event-loop stalls on real servers: `dask scheduler` and `dask worker` subprocesses
whose `distributed.admin.tick.limit` is lowered (it is read when distributed is
imported, so only their environment can set it)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.cluster.test_cli import run
from tests.cluster.test_preload import Preloaded, preloaded
from tests.cluster.workload import add_loop_handlers, hold_gil
from tests.conftest import most_sampled_state, wait_for

GIL_CALL = 80_000_000  # sum(range(n)): about 1.5 s here, one C call that keeps the GIL


@pytest.fixture
def servers(tmp_path):
    env = {"DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": "500ms", "DASK_PYSPY__STALL_THRESHOLD": "200ms"}
    with preloaded(tmp_path, scheduler_preload=True, **env) as cluster:
        cluster.client.run_on_scheduler(add_loop_handlers)
        yield cluster


def stalls_of(cluster: Preloaded, start: float, process: str) -> list[dict[str, Any]]:
    return [s for s in cluster.client.pyspy_stalls(start=start) if s["process"].startswith(process)]


def test_a_scheduler_handler_that_spins_is_a_stall_named_by_its_op(servers):
    start = time.time()
    servers.client.sync(servers.client.scheduler.spin_on_loop, seconds=1.0)

    def named() -> list[dict[str, Any]]:
        return [s for s in stalls_of(servers, start, "scheduler") if s["activity"] == "scheduler: spin_on_loop"]

    (stall,) = wait_for(named, "stall of the handler")
    assert stall["duration"] >= 0.95
    assert stall["address"] == servers.client.scheduler.address
    assert any(frame.startswith("spin") for frame in stall["stack"])
    assert most_sampled_state(stall) in ("cpu-gil", "cpu-wait"), stall["states"]


def test_a_handler_blocking_the_loop_reads_blocked_in_its_system_call(servers):
    start = time.time()
    servers.client.sync(servers.client.scheduler.sleep_on_loop, seconds=1.0)

    def named() -> list[dict[str, Any]]:
        return [s for s in stalls_of(servers, start, "scheduler") if s["activity"] == "scheduler: sleep_on_loop"]

    (stall,) = wait_for(named, "stall of the handler")
    assert most_sampled_state(stall) == "blocked", stall["states"]
    assert stall["call"] in ("clock_nanosleep", "nanosleep", "select", "pselect6")
    assert stall["stack"][0].startswith("sleep_on_loop")


def test_a_task_holding_the_gil_is_named_and_distributed_s_line_explained(servers):
    client = servers.client
    (worker,) = client.scheduler_info()["workers"]
    start = time.time()
    future = client.submit(hold_gil, GIL_CALL)
    future.result()

    def held() -> list[dict[str, Any]]:
        ours = stalls_of(servers, start, worker)
        return [s for s in ours if s["gil_holders"] and s["gil_holders"][0]["task_key"] == future.key]

    stall = wait_for(held, "stall held by the task")[0]
    holder = stall["gil_holders"][0]
    assert holder["prefix"] == "hold_gil" and holder["function"].startswith("hold_gil")
    assert most_sampled_state(stall) == "gil-wait" and holder["seconds"] >= stall["states"]["gil-wait"] / 2, stall
    assert stall["holders"] == "known"

    def explained() -> list[str]:
        log = servers.worker_log.read_text()
        lines = log.splitlines()
        return [
            line
            for before, line in zip(lines, lines[1:])
            if "Event loop was unresponsive in Worker" in before and "dask-pyspy: that" in line and future.key in line
        ]

    line = wait_for(explained, "line of ours after distributed's")[0]
    assert re.search(r"waiting for the GIL held by task \S+ in `hold_gil", line), line


def test_the_cli_prints_the_stalls(servers):
    start = time.time()
    servers.client.sync(servers.client.scheduler.spin_on_loop, seconds=0.6)
    wait_for(lambda: stalls_of(servers, start, "scheduler"), "stall")
    done = run("stalls", "--scheduler", servers.client.scheduler.address, "--last", "120")
    assert done.returncode == 0, done.stderr
    assert "scheduler: spin_on_loop" in done.stdout and "what held the loop" in done.stdout


def test_bad_arguments_are_named(servers):
    with pytest.raises(ValueError, match="min_duration must be a number of seconds"):
        servers.client.pyspy_stalls(min_duration=-1)
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        servers.client.pyspy_stalls(limit=0)
    done = run("stalls", "--scheduler", servers.client.scheduler.address, "--last", "0")
    assert done.returncode == 2 and "--last" in done.stderr


def test_an_idle_cluster_has_no_stalls(client):
    start = time.time()
    # Idle, but for the servers' own periodic work.
    deadline = start + 10
    while time.time() < deadline:
        time.sleep(0.5)
    stalls = client.pyspy_stalls(start=start)
    # On a loaded machine a loop can be kept from a CPU that long: that stall is real.
    busy = [s for s in stalls if s["states"].get("cpu-gil", 0) > s["duration"] / 2]
    assert not busy, busy


@pytest.mark.parametrize("value", ["-1s", "soon"])
def test_a_bad_threshold_leaves_sampling_on(tmp_path, value):
    with preloaded(tmp_path, scheduler_preload=True, DASK_PYSPY__STALL_THRESHOLD=value) as cluster:
        prof = cluster.client.pyspy_profile(last=5, scheduler=False)
        assert prof.processes and not prof.processes[0]["stats"]["stalls"]["watched"]
    assert "config pyspy.stall-threshold must be a positive duration" in cluster.worker_log.read_text()
