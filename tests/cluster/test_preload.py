"""Preload through real `dask scheduler` / `dask worker` subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
from distributed import Client

import dask_pyspy
from tests.cluster.workload import alpha

DASK = str(Path(sys.executable).with_name("dask"))
LOOPBACK = ("--host", "127.0.0.1")  # tests talk to loopback only


class Preloaded(NamedTuple):
    client: Client
    scheduler_log: Path
    worker_log: Path


@contextmanager
def preloaded(tmp_path: Path, scheduler_preload: bool, **extra_env: str) -> Iterator[Preloaded]:
    """A `dask worker --preload dask_pyspy`, and its scheduler, preloaded too (through
    config) if `scheduler_preload`; both with `extra_env` in their environment."""
    scheduler_file = tmp_path / "scheduler.json"
    logs = Preloaded(None, tmp_path / "scheduler.log", tmp_path / "worker.log")
    env = dict(os.environ, DASK_PYSPY__RATE="150", DASK_PYSPY__CPU_BUDGET="0.3", **extra_env)
    if scheduler_preload:
        env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"] = '["dask_pyspy"]'

    def dask(command: str, *args: str, log: Path) -> subprocess.Popen:
        scheduler = ("--scheduler-file", str(scheduler_file))
        return subprocess.Popen([DASK, command, *scheduler, *args], env=env, cwd=tmp_path, stderr=log.open("w"))

    procs = [
        dask("scheduler", *LOOPBACK, "--port", "0", "--dashboard-address", ":0", "--no-show", log=logs.scheduler_log)
    ]
    deadline = time.time() + 60
    while not scheduler_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    procs.append(
        dask("worker", *LOOPBACK, "--preload", "dask_pyspy", "--nthreads", "2", "--no-dashboard", log=logs.worker_log)
    )
    try:
        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            yield logs._replace(client=client)
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(30)


@pytest.fixture
def preloaded_cluster(tmp_path):
    """Both preloads: the scheduler's (through config) and the worker's (--preload)."""
    with preloaded(tmp_path, scheduler_preload=True) as cluster:
        yield cluster


def test_preloaded_scheduler_and_worker_profile_with_config(preloaded_cluster):
    client = preloaded_cluster.client
    start = time.time()
    client.gather(client.map(alpha, range(200)))
    prof = client.pyspy_profile(start=start, by="prefix")
    names = [p["name"] for p in prof.processes]
    (worker,) = client.scheduler_info()["workers"]
    assert worker in names and any(n.startswith("scheduler ") for n in names)
    assert not prof.metadata["missing"]
    for proc in prof.processes:
        assert proc["stats"]["requested_rate"] == 150, "options come from DASK_PYSPY__* config"
    frames = prof.speedscope()["shared"]["frames"]
    assert any(f["name"] == "alpha" and f.get("file") == "dask task" for f in frames)


def worker_profilers(dask_worker) -> list[tuple[int, int, bool]]:
    """(holders, users of the process sampler, tasks tagged) of each profiler in this worker."""
    from dask_pyspy.sampler import process_sampler
    from dask_pyspy.server.worker import TaskTagger, _profilers

    tagged = isinstance(dask_worker.active_threads, TaskTagger)
    return [(p.holders, process_sampler._users, tagged) for p in _profilers.values()]


def our_plugins(dask_worker) -> list[str]:
    from dask_pyspy.server.worker import PySpyWorkerPlugin

    return sorted(name for name, plugin in dask_worker.plugins.items() if isinstance(plugin, PySpyWorkerPlugin))


def test_both_preloads_set_the_worker_up_once(preloaded_cluster):
    client = preloaded_cluster.client
    deadline = time.monotonic() + 60
    # The worker preload and the scheduler's plugin (which replaced the preload's) hold one profiler.
    while list(client.run(worker_profilers).values()) != [[(2, 1, True)]]:
        assert time.monotonic() < deadline, client.run(worker_profilers)
        time.sleep(0.2)
    assert list(client.run(our_plugins).values()) == [["pyspy"]], "one plugin of ours"
    # What distributed's own tests count on: a worker holds the plugins the scheduler gives.
    scheduler_gives = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.worker_plugins))
    assert list(client.run(lambda dask_worker: sorted(dask_worker.plugins)).values()) == [scheduler_gives]


def test_a_plugin_registered_later_keeps_the_preloaded_workers_task_log(tmp_path):
    with preloaded(tmp_path, scheduler_preload=False) as cluster:
        client = cluster.client
        assert list(client.run(our_plugins).values()) == [["pyspy"]], "the preload's own plugin"
        start = time.time()
        client.gather(client.map(alpha, range(50)))
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=150, cpu_budget=0.3))
        assert list(client.run(our_plugins).values()) == [["pyspy"]], "the scheduler's replaced it"
        prof = client.pyspy_profile(start=start)
        (worker,) = client.scheduler_info()["workers"]
        assert prof.metadata["tasks"][worker]["alpha"]["count"] == 50, "tasks logged before the plugin came"


def test_rejected_request_leaves_no_traceback_in_the_scheduler_log(preloaded_cluster):
    client = preloaded_cluster.client
    with pytest.raises(ValueError, match=r"unknown worker addresses \['tcp://127.0.0.1:1'\]"):
        client.pyspy_profile(workers=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="unknown worker addresses"):
        client.pyspy_dump(workers=["tcp://127.0.0.1:1"])
    assert client.pyspy_profile(last=5).processes, "the scheduler still answers"
    log = preloaded_cluster.scheduler_log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log


SNAPSHOT_BEFORE_IMPORT = textwrap.dedent("""
    import json
    import time
    import distributed.utils_test  # takes its config snapshot now, before dask_pyspy is imported
    import dask
    from distributed import Client, LocalCluster
    import dask_pyspy

    if __name__ == "__main__":
        distributed.utils_test.reset_config()  # what gen_cluster does: the pyspy namespace is gone
        assert "pyspy" not in dask.config.config
        preload = {"distributed.scheduler.preload": ["dask_pyspy"], "distributed.worker.preload": ["dask_pyspy"]}
        with dask.config.set(preload), LocalCluster(n_workers=1, processes=True, dashboard_address=":0") as cluster, \\
                Client(cluster) as client:
            deadline = time.monotonic() + 60
            while True:
                prof = client.pyspy_profile(last=60)
                if len(prof.processes) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            print(json.dumps({"processes": [p["name"] for p in prof.processes], "missing": prof.metadata["missing"]}))
""")


def test_config_restored_from_a_snapshot_before_import(tmp_path):
    script = tmp_path / "snapshot.py"
    script.write_text(SNAPSHOT_BEFORE_IMPORT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "KeyError" not in done.stderr and "Failed to start preload" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    assert len(result["processes"]) == 2 and not result["missing"], result
