"""Collecting a cluster's profile: aggregated requests against raw ones, the size cap,
and workers that answer with unusable bytes."""

from __future__ import annotations

import re
import time
import uuid

import dask
import pytest

from tests.cluster.workload import spin_for


def run_prefixes(client, prefixes: dict[str, float], n: int = 40) -> None:
    """`n` tasks per prefix, each spinning the given seconds, with keys never used before."""
    run = uuid.uuid4().hex
    futures = [client.submit(spin_for, s, key=f"{p}-{run}-{i}") for p, s in prefixes.items() for i in range(n)]
    client.gather(futures)


def prefix_totals(prof) -> dict[tuple[str, str], float]:
    """Wall ("seconds") and "cpu" seconds per task prefix."""
    return {(p["prefix"], k): p[k] for p in prof.summary()["prefixes"] for k in ("seconds", "cpu")}


def task_roots(prof) -> set[str]:
    """The task frames that root the by-task view: task keys, or prefixes when aggregated."""
    return {f["name"] for f in prof.speedscope(by="task")["shared"]["frames"] if f["file"] == "dask task"}


def test_aggregated_request_has_the_raw_totals(client, tmp_path):
    prefixes = {"agg_short": 0.004, "agg_long": 0.03}
    start = time.time()
    run_prefixes(client, prefixes)
    stop = time.time()
    raw = client.pyspy_profile(start=start, stop=stop)
    folded = client.pyspy_profile(start=start, stop=stop, aggregate=True)
    assert folded.metadata["aggregate"] is True and raw.metadata["aggregate"] is False
    assert not folded.metadata["missing"], folded.metadata["missing"]
    assert folded.n_samples == raw.n_samples > 0
    # The same samples, summed in another order: equal but for float rounding.
    want, got = prefix_totals(raw), prefix_totals(folded)
    assert set(prefixes) <= {prefix for prefix, _ in want}
    assert got == pytest.approx(want)
    assert folded.sampled_seconds == raw.sampled_seconds
    # 40 keys per prefix fold into their prefix.
    assert not task_roots(raw) & set(prefixes) and len(task_roots(raw)) > 20
    assert set(prefixes) <= task_roots(folded) and len(task_roots(folded)) < 10
    report = folded.save(tmp_path / "aggregated.html").read_text()
    assert all(prefix in report for prefix in prefixes)


def test_aggregate_must_be_a_bool(client):
    with pytest.raises(ValueError, match="aggregate must be True or False"):
        client.pyspy_profile(aggregate="yes")


def test_a_request_over_the_cap_is_refused_before_collecting(client):
    run_prefixes(client, {"capped": 0.002}, n=20)
    with dask.config.set({"pyspy.max-result": "1KiB"}):  # the scheduler runs in this process
        with pytest.raises(
            ValueError, match=r"over config pyspy.max-result \(0 MiB\): ask for aggregate=True or a shorter window"
        ):
            client.pyspy_profile(last=600)
        with pytest.raises(ValueError, match=r"ask for a shorter window"):
            client.pyspy_profile(last=600, aggregate=True)
    with dask.config.set({"pyspy.max-result": "lots"}):
        with pytest.raises(ValueError, match="config pyspy.max-result must be a size in bytes such as '512MiB'"):
            client.pyspy_profile(last=60)
    assert client.pyspy_profile(last=600).n_samples > 0


def answer_with(kind: str):
    """Makes a worker's `pyspy_profile` handler answer with unusable bytes of `kind`."""

    def install(dask_worker) -> None:
        real = dask_worker.handlers["pyspy_profile"]

        async def broken(**kwargs):
            data = (await real(**kwargs)).data  # the bytes in their wrapper (sent as a frame)
            return {"garbage": b"garbage", "oversized": data + b"\0" * (4 << 20), "cut": data[:-64]}[kind]

        dask_worker.handlers["pyspy_profile"] = broken

    return install


@pytest.mark.parametrize(
    "kind, why",
    [
        ("garbage", "an unusable profile: not a dask-pyspy profile"),
        ("oversized", "an unusable profile: .* bytes, more than the .* it announced"),
        ("cut", "an unreadable profile: a damaged body"),
    ],
)
def test_a_worker_answering_unusable_bytes_is_named_missing(fresh, kind, why):
    cluster, client = fresh
    run_prefixes(client, {f"fault_{kind}": 0.005}, n=20)
    victim, survivor = sorted(client.scheduler_info()["workers"])
    client.run(answer_with(kind), workers=[victim])
    prof = client.pyspy_profile(last=600)
    assert list(prof.metadata["missing"]) == [victim]
    assert re.match(why, prof.metadata["missing"][victim]), prof.metadata["missing"]
    names = [p["name"] for p in prof.processes]
    assert survivor in names and victim not in names and any(n.startswith("scheduler") for n in names)
    assert prof.n_samples > 0
