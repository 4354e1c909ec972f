"""Faults, concurrency, lost saves, secrets and TLS: the profiler never takes a cluster down."""

from __future__ import annotations

import os
import threading
import time

import pytest
from distributed import Client, LocalCluster
from distributed.security import Security

import dask_pyspy
from tests.cluster.conftest import start_cluster
from tests.cluster.workload import alpha, beta, gamma


def test_restart_and_retire_while_sampling(fresh):
    cluster, client = fresh
    client.gather(client.map(alpha, range(50)))
    client.restart()
    client.gather(client.map(beta, range(100)))
    after_restart = client.pyspy_profile(last=5, by="prefix")
    workers = list(client.scheduler_info()["workers"])
    assert {p["name"] for p in after_restart.processes} >= set(workers), "restarted workers sample again"
    client.retire_workers([workers[0]])
    prof = client.pyspy_profile(last=30)
    assert workers[0] not in {p["name"] for p in prof.processes} and not prof.metadata["missing"]
    assert client.submit(alpha, 1, key="after-retire").result() == 1


def test_sampler_panic_on_a_worker_is_contained(fresh):
    cluster, client = fresh
    client.gather(client.map(alpha, range(50)))
    victim = list(client.scheduler_info()["workers"])[0]

    def inject_panic() -> None:
        dask_pyspy._native._testing.inject_panic(dask_pyspy.sampler.process_sampler.sampler._native)

    client.run(inject_panic, workers=[victim])

    def panicked() -> bool:
        return client.run(lambda: dask_pyspy.sampler.process_sampler.sampler.stats()["panic"], workers=[victim])[victim]

    deadline = time.monotonic() + 60
    while not panicked():
        assert time.monotonic() < deadline, "the injected panic never happened"
        time.sleep(0.1)
    prof = client.pyspy_profile(last=30)
    stats = {p["name"]: p["stats"] for p in prof.processes}
    assert "panicked" in stats[victim]["panic"], "the panic is reported with the profile"
    assert stats[victim]["ticks"] > 0, "samples taken before the panic are kept"
    assert client.submit(alpha, 2, key="after-panic").result() == 2


def test_scheduler_closed_during_collection(fresh):
    import signal

    cluster, client = fresh
    pid = next(iter(client.run(os.getpid).values()))
    os.kill(pid, signal.SIGSTOP)  # keeps the collection in flight
    errors = []

    def collect():
        try:
            client.pyspy_profile(last=10, timeout=30)
        except Exception as e:  # what the user sees
            errors.append(e)

    t = threading.Thread(target=collect)
    began = time.time()
    t.start()
    time.sleep(1)
    client.sync(cluster.scheduler.close)
    t.join(30)
    os.kill(pid, signal.SIGCONT)
    assert not t.is_alive() and time.time() - began < 30
    assert errors and isinstance(errors[0], OSError), errors
    assert "lost the connection to the scheduler during pyspy_profile" in str(errors[0])


def test_two_clients_and_nested_blocks_get_their_own_windows(client):
    other = Client(client.scheduler.address)
    results = {}

    def record(c, name, fn):
        with dask_pyspy.profile(client=c, by="prefix") as rec:
            c.gather(c.map(fn, range(150), [0.01] * 150, key=[f"{name}-{i}" for i in range(150)]))
        results[name] = rec

    try:
        threads = [
            threading.Thread(target=record, args=(client, "left", alpha)),
            threading.Thread(target=record, args=(other, "right", beta)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        other.close()
    for name, rec in results.items():
        assert rec.profile.metadata["window"] == [rec.start, rec.stop]
        assert name in {p for t in rec.profile.metadata["tasks"].values() for p in t}
    with dask_pyspy.profile(client=client, by="prefix") as outer:
        client.gather(client.map(alpha, range(50), key=[f"outer1-{i}" for i in range(50)]))
        with dask_pyspy.profile(client=client, by="prefix") as inner:
            client.gather(client.map(gamma, range(4), [0.2] * 4, key=[f"inner-{i}" for i in range(4)]))
        client.gather(client.map(alpha, range(50), key=[f"outer2-{i}" for i in range(50)]))
    inner_tasks = {p for t in inner.profile.metadata["tasks"].values() for p in t}
    outer_tasks = {p for t in outer.profile.metadata["tasks"].values() for p in t}
    assert inner_tasks == {"inner"}
    assert {"outer1", "inner", "outer2"} <= outer_tasks
    assert outer.start <= inner.start <= inner.stop <= outer.stop


def test_failed_save_keeps_the_profile(client, tmp_path, caplog):
    target = tmp_path / "gone"
    target.mkdir()
    with pytest.raises(OSError) as err:
        with dask_pyspy.profile(target / "p.json.gz", client=client) as rec:
            client.gather(client.map(alpha, range(50)))
            target.rmdir()  # the directory disappears while the workload runs
    message = str(err.value)
    assert "could not save the profile" in message and "it was kept at" in message
    kept = message.split("it was kept at '")[1].split("'")[0]
    assert os.path.getsize(kept) > 0 and kept.endswith(".json.gz")
    assert rec.profile is not None and rec.profile.n_samples > 0
    assert kept in caplog.text
    os.unlink(kept)


def test_unwritable_directory_names_the_given_path(client):
    prof = client.pyspy_profile(last=10)
    # /proc refuses new files even to root, whom os.access lets write anywhere.
    with pytest.raises(OSError) as err:
        prof.save("/proc/pyspy-report.html")
    assert "cannot write '/proc/pyspy-report.html'" in str(err.value) and ".tmp" not in str(err.value)


def test_locals_are_never_collected(client):
    secret = "hunter2-" + "s3cr3t" * 3

    def holds_a_secret(seconds):
        password = secret  # noqa: F841 - a local the profiler must not read
        end = time.time() + seconds
        while time.time() < end:
            sum(range(100))

    future = client.submit(holds_a_secret, 1.0, key="holds-secret")
    time.sleep(0.5)
    dump = str(client.pyspy_dump())
    future.result()
    prof = client.pyspy_profile(last=10)
    assert "holds_a_secret" in dump
    assert secret not in dump
    assert secret.encode() not in prof.to_bytes(compress=False)
    assert secret not in prof.to_html()


def test_blocked_handlers_are_honoured():
    import dask

    with dask.config.set({"distributed.scheduler.blocked-handlers": ["pyspy_profile"]}):
        cluster, client = start_cluster(processes=False)
    try:
        with pytest.raises(ValueError, match="'pyspy_profile' handler has been explicitly disallowed"):
            client.pyspy_profile()
        assert "Process scheduler" in str(client.pyspy_dump()), "other handlers still work"
    finally:
        client.close()
        cluster.close()


def test_tls_cluster():
    sec = Security.temporary()
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=True, security=sec, dashboard_address=":0"
        ) as cluster,
        Client(cluster, security=sec) as client,
    ):
        assert client.scheduler.address.startswith("tls://")
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3))
        start = time.time()
        client.gather(client.map(alpha, range(100)))
        prof = client.pyspy_profile(start=start)
        assert len(prof.processes) == 2 and not prof.metadata["missing"]


def test_unreadable_worker_reports_its_error_and_the_cluster_runs():
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            env={"DASK_PYSPY_TESTING": "unreadable"},
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin())
        (worker,) = client.scheduler_info()["workers"]
        assert client.submit(alpha, 3, key="still-runs").result() == 3
        prof = client.pyspy_profile(last=10)
        assert "py-spy cannot read this Python process" in prof.metadata["missing"][worker]
        assert [p["name"] for p in prof.processes] == [f"scheduler {client.scheduler.address}"]
