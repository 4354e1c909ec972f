"""Wall time, CPU time and the GIL on a real cluster: a task blocked on I/O shows wall
without CPU; a numpy kernel shows CPU without the GIL."""

from __future__ import annotations

import time

from tests.cluster.workload import matmul, wait_io


def test_io_and_numpy_tasks_split_as_they_ran(client):
    start = time.time()
    io_futures = client.map(wait_io, range(12), pure=False)
    used = sum(client.gather(client.map(matmul, range(12), pure=False)))
    client.gather(io_futures)
    prof = client.pyspy_profile(start=start)
    rows = {p["prefix"]: p for p in prof.summary()["prefixes"]}
    io, np_ = rows["wait_io"], rows["matmul"]
    # 12 tasks x 0.3 s each: the waits are sampled though the thread uses no CPU.
    assert io["seconds"] >= 0.5 * 12 * 0.3, io
    assert io["blocked"] >= 0.9 * io["seconds"] and io["cpu"] <= 0.1 * io["seconds"], io
    assert np_["no_gil"] > 2 * np_["gil"], np_
    # CPU against what the tasks' threads used, not against wall time: a kernel waits
    # for a core (4 task threads on 2 cores: CPU 28% of wall idle, 16% beside stress-ng).
    assert 0.5 * used <= np_["cpu"] <= 1.5 * used, (np_, used)

    by_cpu = {p["name"]: p["endValue"] for p in prof.speedscope(by="prefix", weight="cpu")["profiles"]}
    by_wall = {p["name"]: p["endValue"] for p in prof.speedscope(by="prefix")["profiles"]}
    name = "wait_io (all threads, task code only)"
    assert by_wall[name] >= 0.5 * 12 * 0.3
    assert by_cpu.get(name, 0.0) <= 0.1 * by_wall[name], "weighted by CPU, a wait weighs nothing"
