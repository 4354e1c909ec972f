"""pprof files of a real cluster, read by Go's own pprof tool (ci/test.sh installs golang-go)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from distributed import span

from dask_pyspy import Profile
from dask_pyspy.client import save_or_keep
from tests.cluster.workload import alpha, gamma

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "mins": 60.0, "hrs": 3600.0}


def go_pprof(path: Path, *args: str) -> str:
    """`go tool pprof ARGS path`'s report. A missing go fails the test: it is a requirement."""
    assert shutil.which("go"), "go is missing: ci/test.sh installs golang-go"
    home = path.parent / "go-home"
    env = {**os.environ, "HOME": str(home), "GOCACHE": str(home / "cache")}
    done = subprocess.run(
        ["go", "tool", "pprof", *args, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def top_functions(report: str) -> set[str]:
    """The function names of a -top report (the last column of its table)."""
    rows = report.split("cum%\n", 1)[1].splitlines()
    return {row.split(maxsplit=5)[5] for row in rows}


def top_total_seconds(report: str) -> float:
    """-top's 'of 2275.40ms total', in seconds."""
    amount, unit = re.search(r"of ([0-9.]+)([a-z]+) total", report).groups()
    return float(amount) * UNITS[unit]


def tags(report: str) -> dict[str, set[str]]:
    """A -tags report as {label key: its values}."""
    out: dict[str, set[str]] = {}
    for line in report.splitlines():
        key = re.match(r"\s*(\w+): Total ", line)
        value = re.match(r"\s*\S+ \(\s*[0-9.]+%\): (.*)$", line)
        if key:
            values = out.setdefault(key.group(1), set())
        elif value:
            values.add(value.group(1))
    return out


@pytest.fixture(scope="module")
def recorded(client, tmp_path_factory) -> tuple[Profile, Path]:
    """A window of alpha tasks in the span "load" / "parse" and gamma tasks outside it, and its .pb.gz file."""
    start = time.time()
    # pure=False: keys of their own, never results an earlier test left in memory.
    with span("load"), span("parse"):
        futures = client.map(alpha, range(40), [0.05] * 40, pure=False)
    futures += client.map(gamma, range(4), [0.3] * 4, pure=False)
    client.gather(futures)
    prof = client.pyspy_profile(start=start)
    assert {p["prefix"] for p in prof.summary()["prefixes"]} == {"alpha", "gamma"}
    return prof, prof.save(tmp_path_factory.mktemp("pprof") / "cluster.pb.gz")


def test_top_names_the_workload_and_its_wall_time(recorded):
    prof, path = recorded
    report = go_pprof(path, "-top")
    assert "Type: wall" in report, report
    assert {"alpha", "gamma", "spin"} <= top_functions(report), report
    assert top_total_seconds(report) == pytest.approx(prof.sampled_seconds, rel=0.01), report
    gamma_only = top_functions(go_pprof(path, "-top", "-tagfocus=task_prefix=gamma"))
    assert "gamma" in gamma_only and "alpha" not in gamma_only, "labels are on the right samples"
    in_load = top_functions(go_pprof(path, "-top", "-tagfocus=span=load"))  # the user guide's example
    assert "alpha" in in_load and "gamma" not in in_load, in_load


def test_tags_name_tasks_processes_and_threads(recorded):
    prof, path = recorded
    labels = tags(go_pprof(path, "-tags"))
    assert labels["task_prefix"] == {"alpha", "gamma"}, labels
    assert "load / parse" in labels["span"] and "default" in labels["span"], labels
    assert len(labels["task_key"]) > 4 and all(k.startswith(("alpha-", "gamma-")) for k in labels["task_key"]), labels
    sampled = {p["name"] for p in prof.summary()["processes"] if p["samples"]}
    assert labels["process"] == sampled, labels
    workers = {p["name"] for p in prof.processes if not p["name"].startswith("scheduler")}
    for worker in workers & sampled:
        assert any(t.startswith(worker) for t in labels["thread"]), (worker, labels["thread"])


def test_a_failed_save_keeps_a_pprof_file(recorded, tmp_path):
    prof, _ = recorded
    with pytest.raises(OSError, match="it was kept at") as err:
        save_or_keep(prof, "/proc/dask-pyspy.pb.gz")
    kept = Path(shutil.move(re.search(r"kept at '([^']+)'", str(err.value)).group(1), tmp_path))
    assert kept.name.endswith(".pb.gz")
    assert "alpha" in top_functions(go_pprof(kept, "-top"))


def test_empty_window_and_bad_suffix(client, tmp_path):
    long_ago = time.time() - 3600
    prof = client.pyspy_profile(start=long_ago - 60, stop=long_ago)
    with pytest.raises(ValueError, match=r"cannot save '.*empty\.pb\.gz': the profile holds no samples"):
        prof.save(tmp_path / "empty.pb.gz")
    assert not (tmp_path / "empty.pb.gz").exists()
    with pytest.raises(ValueError, match=r"path must end in .*\.pb\.gz \(pprof\).*got '.*out\.pb'"):
        prof.save(tmp_path / "out.pb")
