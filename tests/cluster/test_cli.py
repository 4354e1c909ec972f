"""`dask pyspy ...` against a real cluster started by the test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import LocalCluster

from dask_pyspy import Profile
from dask_pyspy.demo import sized
from tests.cluster.workload import alpha

DASK = str(Path(sys.executable).with_name("dask"))


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([DASK, "pyspy", *args], capture_output=True, text=True, timeout=timeout)


def test_record_writes_a_report(client, tmp_path):
    address = client.scheduler.address
    futures = client.map(alpha, range(400), [0.01] * 400)
    out = tmp_path / "cli.html"
    done = run("record", "--scheduler", address, "--duration", "2", "-o", str(out), "--by", "prefix")
    client.gather(futures)
    assert done.returncode == 0, done.stderr
    assert "Saved" in done.stdout and out.exists()
    # The profile's findings open the output, as Profile.summary() prints them (which
    # prefixes the 2 s caught depends on the machine's load; test_demo compares the text).
    opened = re.search(r"^Profiled \d+\.\d s, ", done.stdout, re.M)
    assert opened and opened.start() < done.stdout.index("Saved"), done.stdout
    assert "iframe" in out.read_text()


def test_dump_prints_live_stacks(client):
    done = run("dump", "--scheduler", client.scheduler.address)
    assert done.returncode == 0, done.stderr
    assert "Process scheduler" in done.stdout and "Thread 0x" in done.stdout


def test_demo_prints_the_profiles_window(tmp_path):
    """Sized to the machine, quiet, and ending with where the report is and what it found."""
    out = tmp_path / "demo.pyspy.gz"
    done = run("demo", "--days", "1", "-o", str(out))
    assert done.returncode == 0, done.stderr
    workers, threads = sized(len(os.sched_getaffinity(0)))
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"Cluster up: {workers} worker{'s' if workers > 1 else ''} x {threads} thread"), lines
    # distributed's scheduler warns as each shuffle starts; the demo's level keeps that out.
    assert " - WARNING - " not in done.stdout + done.stderr, done.stderr
    prof = Profile.load(out)
    assert len(prof.processes) == workers + 1, [p["name"] for p in prof.processes]
    printed = float(re.search(r"Profiled ([0-9.]+) s", done.stdout).group(1))
    start, stop = prof.metadata["window"]
    assert printed == pytest.approx(stop - start, abs=0.05), done.stdout  # not the cluster's shutdown too
    summary = prof.summary()
    # The same findings as Profile.summary() prints, then the sampler's cost, then the report.
    assert lines[-1] == f"Report: {out}", lines
    assert str(summary) in done.stdout, (str(summary), done.stdout)
    assert f"  {summary['prefixes'][0]['prefix']}: " in done.stdout
    slow = next(p for p in summary["prefixes"] if p["prefix"] == "slow_python_loop")
    assert slow["top"][0]["name"] == "slow_python_loop", slow["top"]


def test_demo_workers_speak_only_of_errors():
    """The demo's worker processes too: a `logging` dask config would not reach them."""
    done = subprocess.run([sys.executable, "-c", SAY_IN_EVERY_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for where in ("worker", "scheduler"):
        assert f"{where} says ERROR" in done.stderr, done.stderr
        assert f"{where} says WARNING" not in done.stderr, done.stderr


SAY_IN_EVERY_PROCESS = """
import logging
from distributed import Client
from dask_pyspy.demo import local_cluster

def say(level, where):
    logging.getLogger("distributed.worker").log(level, "%s says %s", where, logging.getLevelName(level))

with local_cluster(1, 1) as cluster, Client(cluster) as client:
    for level in (logging.WARNING, logging.ERROR):
        client.run(say, level, "worker")
        say(level, "scheduler")
"""


@pytest.mark.parametrize("command", [[], ["record"], ["dump"], ["stalls"], ["demo"], ["diff"]])
def test_help(command):
    done = run(*command, "--help")
    assert done.returncode == 0 and "Usage:" in done.stdout


def one_line_error(done: subprocess.CompletedProcess, message: str) -> None:
    """A refused request: exit code 2 and a single line saying why, no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert lines[0].startswith("Error: ") and message in lines[0], lines


def timed_run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = run(*args)
    return done, time.monotonic() - began


def test_unreachable_scheduler_fails_in_seconds(tmp_path):
    nowhere = ("--scheduler", "tcp://127.0.0.1:1", "-o", str(tmp_path / "x.html"))
    quick, quick_took = timed_run("record", *nowhere, "--timeout", "0.5")
    done, took = timed_run("record", *nowhere)
    one_line_error(
        quick,
        "cannot reach the scheduler at tcp://127.0.0.1:1: Timed out trying to connect to tcp://127.0.0.1:1 after 0.5 s",
    )
    one_line_error(done, "after 2 s")
    # Both pay the same start-up; the default waits 1.5 s longer (the old 10 s default, 9.5 s).
    assert took < quick_took + 6, (took, quick_took)
    one_line_error(run("dump", "--scheduler", "tcp://127.0.0.1:1"), "after 2 s")


def test_cluster_without_the_plugin_fails_before_recording(tmp_path):
    with LocalCluster(n_workers=1, processes=False, protocol="tcp", dashboard_address=":0") as cluster:
        done, took = timed_run(
            "record", "--scheduler", cluster.scheduler_address, "--duration", "60", "-o", str(tmp_path / "x.html")
        )
        dumped = run("dump", "--scheduler", cluster.scheduler_address)
    one_line_error(done, "no dask-pyspy plugin")
    assert took < 40, f"the check came after the recording: {took:.0f} s"
    assert not (tmp_path / "x.html").exists()
    one_line_error(dumped, "no dask-pyspy plugin")


def test_unknown_worker_fails_before_recording(client, tmp_path):
    address = client.scheduler.address
    done, took = timed_run(
        "record",
        "--scheduler",
        address,
        "--duration",
        "60",
        "--workers",
        "tcp://127.0.0.1:1",
        "-o",
        str(tmp_path / "x.html"),
    )
    one_line_error(done, "unknown worker addresses ['tcp://127.0.0.1:1']")
    assert took < 40, f"the check came after the recording: {took:.0f} s"
    one_line_error(run("dump", "--scheduler", address, "--workers", "tcp://127.0.0.1:1"), "unknown worker addresses")


@pytest.mark.parametrize("command", ["record", "dump"])
def test_zero_workers_is_a_usage_error(client, command):
    done = run(command, "--scheduler", client.scheduler.address, "--workers", "0")
    one_line_error(done, "--workers: workers must be None, a positive number of workers")


def test_unwritable_directory_names_the_given_path(client):
    done = run("record", "--scheduler", client.scheduler.address, "--duration", "0.5", "-o", "/proc/pyspy-cli.html")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "cannot write '/proc/pyspy-cli.html'" in done.stderr and ".tmp" not in done.stderr, done.stderr
    kept = done.stderr.split("it was kept at '")[1].split("'")[0]
    assert os.path.getsize(kept) > 0
    os.unlink(kept)


def test_bad_output_fails_before_recording(client, tmp_path):
    done = run("record", "--scheduler", client.scheduler.address, "-o", str(tmp_path / "x.txt"))
    one_line_error(done, "--output: path must end in")


def test_diff_of_bad_files_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.pyspy.gz"
    garbage.write_bytes(b"not a profile")
    missing = str(tmp_path / "missing.json")
    one_line_error(run("diff", missing, str(garbage)), f"BASE: [Errno 2] No such file or directory: {missing!r}")
    one_line_error(run("diff", str(garbage), missing), f"BASE: cannot load {str(garbage)!r}: not gzip-compressed")
    other = str(tmp_path / "a.txt")
    one_line_error(
        run("diff", other, missing), f"BASE: cannot load {other!r}: the path must end in .pyspy.gz, .json or .json.gz"
    )
    one_line_error(run("diff", missing, missing, "-o", str(tmp_path / "d.json")), "--output: path must end in .html")
    nowhere = str(tmp_path / "nowhere" / "d.html")
    one_line_error(run("diff", missing, missing, "-o", nowhere), f"--output: cannot write {nowhere!r}: directory")
