"""Preload through real `dask scheduler` / `dask worker` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client

from tests.integration.workload import alpha

DASK = str(Path(sys.executable).with_name("dask"))


@pytest.fixture
def preloaded_cluster(tmp_path):
    scheduler_file = tmp_path / "scheduler.json"
    env = dict(os.environ, DASK_PYSPY__RATE="150", DASK_PYSPY__CPU_BUDGET="0.3",
               DASK_DISTRIBUTED__SCHEDULER__PRELOAD='["dask_pyspy"]')
    procs = [
        subprocess.Popen([DASK, "scheduler", "--scheduler-file", str(scheduler_file), "--port", "0",
                          "--dashboard-address", ":0", "--no-show"], env=env, cwd=tmp_path),
    ]
    deadline = time.time() + 60
    while not scheduler_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    procs.append(subprocess.Popen([DASK, "worker", "--scheduler-file", str(scheduler_file), "--preload", "dask_pyspy",
                                   "--nthreads", "2", "--no-dashboard"], env=env, cwd=tmp_path))
    try:
        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            yield client
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(30)


def test_preloaded_scheduler_and_worker_profile_with_config(preloaded_cluster):
    client = preloaded_cluster
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
