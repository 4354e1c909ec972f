"""A real LocalCluster with worker processes, profiled end to end."""

from __future__ import annotations

import logging
import re
import time

import pytest
from dask.utils import key_split
from distributed import Client, LocalCluster

import dask_pyspy
from dask_pyspy import states
from tests.cluster.conftest import start_cluster
from tests.cluster.workload import Counter, alpha, beta, coroutine_task, gamma, sleeper, spin_until
from tests.conftest import frame_names, wait_for


def run_mixed_workload(client: Client, round: int = 0) -> None:
    """Many short tasks of two prefixes (str and tuple keys) and a few long ones."""
    futures = [client.submit(alpha, i, key=f"alpha-{round}-{i}") for i in range(300)]
    futures += [client.submit(beta, i, key=("beta", round, i)) for i in range(300)]
    futures += [client.submit(gamma, i, key=f"gamma-{round}-{i}") for i in range(4)]
    client.gather(futures)


def tagged_samples(doc: dict) -> list[tuple[str, list[str], float]]:
    """(task prefix, stack function names, weight) of every task-tagged sample."""
    out = []
    frames = doc["shared"]["frames"]
    for prof in doc["profiles"]:
        for sample, weight in zip(prof["samples"], prof["weights"]):
            if frames[sample[0]].get("file") == "dask task":
                names = frame_names(doc, sample)
                out.append((names[0], names[1:], weight))
    return out


TASK_FUNCTIONS = {"alpha", "beta", "gamma"}


def check_attribution(doc: dict) -> None:
    """Of the tagged samples that run a task function, >= 99% are tagged with that task.

    Tagged samples with no task function on the stack are distributed's own per-task
    work (result sizeof, metering) inside `_run_task`: rightly charged to the task.
    """
    tagged = tagged_samples(doc)
    prefixes = {prefix for prefix, _, _ in tagged}
    assert TASK_FUNCTIONS <= prefixes, prefixes
    running = [(prefix, TASK_FUNCTIONS & set(names)) for prefix, names, _ in tagged]
    right = [{prefix} == functions for prefix, functions in running if functions]
    assert len(right) > 50, "enough samples to judge"
    assert sum(right) >= 0.99 * len(right), f"{len(right) - sum(right)} of {len(right)} samples mislabelled"


@pytest.mark.parametrize("processes", [True, False])
def test_task_attribution(processes, client):
    if processes:
        c = client
    else:
        cluster, c = start_cluster(processes=False)
    try:
        start = time.time()
        # Again until every prefix was sampled: py-spy's reader (3.9, 3.10) on a busy
        # machine may miss 0.6 s of 2 ms tasks.
        for rounds in range(1, 6):
            run_mixed_workload(c, rounds)
            prof = c.pyspy_profile(start=start, by="prefix")
            if TASK_FUNCTIONS <= {prefix for prefix, _, _ in tagged_samples(prof.speedscope())}:
                break
        check_attribution(prof.speedscope())
        names = [p["name"] for p in prof.processes]
        workers = list(c.scheduler_info()["workers"])
        if processes:
            assert sorted(n for n in names if not n.startswith("scheduler")) == sorted(workers)
            assert any(n.startswith("scheduler ") for n in names)
        else:
            assert len(names) == 1, "one sampler per process, shared by scheduler and workers"
        # Worker threads carry their worker's address, so shared processes still attribute.
        labels = [p["name"] for p in prof.speedscope()["profiles"]]
        for w in workers:
            assert any(w in label and "Dask-Default-Threads" in label for label in labels), (w, labels)
        tasks = prof.metadata["tasks"]
        # A worker that ran no alpha task has no row for it.
        assert sum(t.get("alpha", {}).get("count", 0) for t in tasks.values()) == 300 * rounds
    finally:
        if not processes:
            c.close()
            cluster.close()


def test_task_keys_of_every_type(client):
    start = time.time()
    futures = [
        client.submit(gamma, 0, 0.4, key="gamma-strkey"),
        client.submit(gamma, 1, 0.4, key=("gamma-tuple", 7)),
        client.submit(gamma, 2, 0.4, key=12345),
    ]
    client.gather(futures)
    doc = client.pyspy_profile(start=start, by="task").speedscope()
    roots = {key for key, names, _ in tagged_samples(doc) if "gamma" in names}
    assert {"gamma-strkey", "('gamma-tuple', 7)", "12345"} <= roots, roots
    prefixes = {p for p, _, _ in tagged_samples(client.pyspy_profile(start=start, by="prefix").speedscope())}
    assert {key_split("gamma-strkey"), key_split(("gamma-tuple", 7)), key_split(12345)} <= prefixes


def test_actors_are_tagged_and_coroutine_tasks_do_not_break_anything(client):
    counter = client.submit(Counter, actor=True, key="counter-actor").result()
    start = time.time()
    assert counter.work(0.5).result() == 1
    assert client.submit(coroutine_task, 0.2, key="coroutine-task").result() == 0.2
    doc = client.pyspy_profile(start=start, by="task").speedscope()
    actor_samples = [names for key, names, _ in tagged_samples(doc) if key == "counter-actor.work"]
    assert actor_samples and all("Counter.work" in names for names in actor_samples if "spin" in names)


def test_worker_selection_and_window(client):
    workers = list(client.scheduler_info()["workers"])
    start = time.time()
    client.gather(client.map(alpha, range(50)))
    one = client.pyspy_profile(workers=[workers[0]], scheduler=False, start=start)
    assert [p["name"] for p in one.processes] == [workers[0]]
    sampled = client.pyspy_profile(workers=1, scheduler=False, last=30)
    assert len(sampled.processes) == 1 and sampled.processes[0]["name"] in workers
    assert sampled.metadata["window"][1] - sampled.metadata["window"][0] == pytest.approx(30, abs=1)
    future = client.pyspy_profile(start=time.time() + 3600)
    assert future.n_samples == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": 0}, "workers must be None, a positive number"),
        ({"workers": ["tcp://127.0.0.1:1"]}, "unknown worker addresses"),
        ({"last": -5}, "last must be a positive number of seconds"),
        ({"start": 10.0, "stop": 5.0}, "stop must not be before start"),
        ({"by": "worker"}, "by must be one of"),
        ({"last": 5, "start": 1.0}, "either last or start/stop"),
        ({"timeout": 0}, r"timeout must be a positive number of seconds, got 0"),
        ({"timeout": -1}, r"timeout must be a positive number of seconds, got -1"),
    ],
)
def test_bad_requests(client, kwargs, message):
    with pytest.raises(ValueError, match=message):
        client.pyspy_profile(**kwargs)


def test_bad_timeout_in_the_schedulers_config(client):
    import dask

    with dask.config.set({"pyspy.timeout": "0s"}):  # LocalCluster's scheduler runs in this process
        with pytest.raises(ValueError, match="config pyspy.timeout must be a positive number of seconds, got 0"):
            client.pyspy_profile(last=5)
    assert client.pyspy_profile(last=5).processes, "the scheduler still answers"


def test_without_plugin_the_error_says_what_to_do(caplog):
    scheduler_log = logging.getLogger("distributed")  # it does not propagate to caplog's root handler
    scheduler_log.addHandler(caplog.handler)
    try:
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
            with pytest.raises(
                RuntimeError, match=r"register_plugin\(dask_pyspy.PySpyPlugin\(\)\).*--preload dask_pyspy"
            ):
                c.pyspy_profile()
            with pytest.raises(RuntimeError, match="no dask-pyspy plugin"):
                c.pyspy_dump()
    finally:
        scheduler_log.removeHandler(caplog.handler)
    assert "No handler" not in caplog.text and "Traceback" not in caplog.text, "the scheduler logged the call"


def test_registering_twice_keeps_one_sampler(client):
    before = client.run(lambda: __import__("dask_pyspy").sampler.process_sampler._users)
    client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3))
    assert client.run(lambda: __import__("dask_pyspy").sampler.process_sampler._users) == before


def sampler_stats(client: Client, workers: list[str] | None = None) -> dict[str, dict | None]:
    """Each process's sampler stats (None where no sampler runs yet), the scheduler's last."""

    def stats() -> dict | None:
        sampler = dask_pyspy.sampler.process_sampler.sampler
        return sampler.stats() if sampler is not None and sampler.is_running else None

    out = client.run(stats, workers=workers)
    if workers is None:
        out["scheduler"] = client.run_on_scheduler(stats)
    return out


def wait_for_stats(client: Client, done, workers: list[str] | None = None, seconds: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + seconds
    while True:
        stats = sampler_stats(client, workers)
        if all(s is not None and done(s) for s in stats.values()):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def test_registering_again_applies_new_options_and_keeps_history(fresh, recwarn):
    cluster, client = fresh
    start = time.time()
    client.gather(client.map(alpha, range(200), key=[f"alpha-before-{i}" for i in range(200)]))
    stop = time.time()
    before = client.pyspy_profile(start=start, stop=stop)
    assert before.n_samples > 0
    assert {s["requested_rate"] for s in sampler_stats(client).values()} == {200}

    client.register_plugin(dask_pyspy.PySpyPlugin(rate=50, cpu_budget=0.3))
    # Every sampler restarted at the new rate: measured over 2 s of its new run.
    stats = wait_for_stats(client, lambda s: s["duration_s"] >= 2)
    for name, s in stats.items():
        assert s["requested_rate"] == 50 and 0 < s["achieved_rate"] <= 52.5, (name, s["achieved_rate"])
    # What was taken before is kept: the samples and each worker's task log.
    after = client.pyspy_profile(start=start, stop=stop)
    assert after.n_samples >= before.n_samples
    assert sum(t["alpha-before"]["count"] for t in after.metadata["tasks"].values() if "alpha-before" in t) == 200

    # Future workers start with the new options.
    known = set(client.scheduler_info()["workers"])
    cluster.scale(3)
    client.wait_for_workers(3, timeout=60)
    new = list(set(client.scheduler_info()["workers"]) - known)
    assert [s["requested_rate"] for s in wait_for_stats(client, lambda s: True, workers=new).values()] == [50]

    # The same options again change nothing: no sampler restarts.
    started = {name: s["started"] for name, s in sampler_stats(client).items()}
    client.register_plugin(dask_pyspy.PySpyPlugin(rate=50, cpu_budget=0.3))
    assert {name: s["started"] for name, s in sampler_stats(client).items()} == started
    assert not [w for w in recwarn if "overwriting" in str(w.message)], (
        "the replaced plugin is not overwritten with a warning"
    )


def test_live_dump_shows_running_tasks(client):
    future = client.submit(sleeper, 5, key="sleeper-dumped")
    deadline = time.time() + 30
    while time.time() < deadline:
        stacks = client.pyspy_dump()
        running = [
            th for proc in stacks["processes"].values() for th in proc["threads"] if th["task"] == "sleeper-dumped"
        ]
        # The task's key is on its thread from when distributed marks it busy, which
        # is a moment before its function's frame (metering, argument unpacking).
        if running and running[0]["frames"][0]["name"] in ("sleeper", "sleep"):
            break
        time.sleep(0.2)
    assert running and running[0]["frames"][0]["name"] in ("sleeper", "sleep"), running
    text = str(stacks)
    assert "task sleeper-dumped" in text and "Process scheduler" in text
    future.result()


# A thread running Python is on a CPU or waiting for one, or for the GIL: never idle.
BUSY = {states.name(code) for code in ("cpu-gil", "cpu", "cpu-wait", "gil-wait")}


def dumped_spinners(client, keys):
    """The first dump in which every task of `keys` runs in `spin_until`, by key."""

    def spinning():
        stacks = client.pyspy_dump()
        threads = {th["task"]: th for proc in stacks["processes"].values() for th in proc["threads"]}
        if all(k in threads and "spin_until" in [f["name"] for f in threads[k]["frames"]] for k in keys):
            return stacks, threads
        return None

    return wait_for(spinning, "dump with every task in spin_until")


def test_dump_names_busy_threads_by_their_state(client, tmp_path):
    """Two task threads spinning in one worker contend for the GIL: the dump prints each
    as the report names its state (py-spy's old flag printed a waiting one 'idle')."""
    done = str(tmp_path / "done")
    worker = next(iter(client.scheduler_info()["workers"]))
    keys = ["dump-spin-0", "dump-spin-1"]
    futures = [client.submit(spin_until, done, key=k, workers=[worker]) for k in keys]
    try:
        stacks, threads = dumped_spinners(client, keys)
    finally:
        open(done, "w").close()
    client.gather(futures)
    for key in keys:
        line = next(line for line in str(stacks).splitlines() if line.endswith(f"task {key}"))
        state = re.match(r"Thread 0x[0-9a-f]+ \((.*?)(, holding the GIL)?\): ", line).group(1)
        assert state == states.name(threads[key]["state"]) and state in BUSY, line
        assert "idle" not in line, line


def test_profile_context_manager_records_its_block(client, tmp_path):
    path = tmp_path / "block.speedscope.json.gz"
    client.gather(client.map(beta, range(100), key=[f"beta-before-{i}" for i in range(100)]))
    with dask_pyspy.profile(path, client=client, by="prefix") as rec:
        client.gather(client.map(alpha, range(200)))
    assert path.exists()
    prefixes = {p for p, _, _ in tagged_samples(rec.profile.speedscope())}
    assert "alpha" in prefixes and "beta" not in prefixes
    assert rec.profile.metadata["window"] == [rec.start, rec.stop]
    with pytest.raises(OSError, match="does not exist"):
        with dask_pyspy.profile(tmp_path / "nope" / "x.json", client=client):
            pytest.fail("the block must not run when the output cannot be written")


def test_config_defaults_and_overrides():
    import dask

    assert dask.config.get("pyspy.rate") == 100
    assert dask.config.get("pyspy.cpu_budget") == 0.01
    with dask.config.set({"pyspy.rate": 250, "pyspy.max-memory": "8MiB"}):
        plugin = dask_pyspy.PySpyPlugin()
        assert plugin.sampler_options.rate == 250
        assert plugin.sampler_options.max_memory == 8 * 2**20
    with pytest.raises(ValueError, match="rate must be in"):
        dask_pyspy.PySpyPlugin(rate=-1)
