"""Workers that die, hang or join while a profile is collected."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.cluster.workload import alpha


def test_worker_killed_during_collection(fresh):
    cluster, client = fresh
    client.gather(client.map(alpha, range(100)))
    pids = client.run(os.getpid)
    victim, survivor = sorted(pids)
    os.kill(pids[victim], signal.SIGSTOP)  # it cannot answer: the collection waits on it
    result = {}
    collecting = threading.Thread(target=lambda: result.update(p=client.pyspy_profile(last=60, timeout=20)))
    began = time.time()
    collecting.start()
    time.sleep(1.0)
    assert collecting.is_alive(), "the collection is waiting for the stopped worker"
    os.kill(pids[victim], signal.SIGKILL)
    collecting.join(25)
    assert not collecting.is_alive()
    assert time.time() - began < 20, "a dead worker is noticed before the timeout"
    prof = result["p"]
    assert victim in prof.metadata["missing"]
    names = [p["name"] for p in prof.processes]
    assert survivor in names and any(n.startswith("scheduler") for n in names)
    assert prof.n_samples > 0
    # The cluster keeps working.
    assert client.submit(alpha, 1, key="after-kill").result(timeout=30) == 1


def test_hung_worker_times_out_and_the_rest_is_returned(fresh):
    cluster, client = fresh
    pids = client.run(os.getpid)
    victim, survivor = sorted(pids)
    os.kill(pids[victim], signal.SIGSTOP)
    try:
        began = time.time()
        prof = client.pyspy_profile(last=30, timeout=2)
        assert time.time() - began < 10
        assert "no answer within 2 s" in prof.metadata["missing"][victim]
        assert survivor in [p["name"] for p in prof.processes]
    finally:
        os.kill(pids[victim], signal.SIGCONT)


def test_worker_joining_during_the_window(fresh):
    cluster, client = fresh
    start = time.time()
    cluster.scale(3)
    client.wait_for_workers(3, timeout=60)
    workers = list(client.scheduler_info()["workers"])
    client.gather(client.map(alpha, range(300), [0.01] * 300))
    prof = client.pyspy_profile(start=start)
    names = {p["name"] for p in prof.processes}
    assert set(workers) <= names, (workers, names)
    assert not prof.metadata["missing"]
