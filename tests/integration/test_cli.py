"""`dask pyspy ...` against a real cluster started by the test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from distributed import LocalCluster

from tests.integration.workload import alpha

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
    assert "iframe" in out.read_text()


def test_dump_prints_live_stacks(client):
    done = run("dump", "--scheduler", client.scheduler.address)
    assert done.returncode == 0, done.stderr
    assert "Process scheduler" in done.stdout and "Thread 0x" in done.stdout


@pytest.mark.parametrize("command", [[], ["record"], ["dump"], ["demo"]])
def test_help(command):
    done = run(*command, "--help")
    assert done.returncode == 0 and "Usage:" in done.stdout


def test_unreachable_scheduler():
    done = run("dump", "--scheduler", "tcp://127.0.0.1:1", "--timeout", "2")
    assert done.returncode != 0
    assert "cannot reach the scheduler at tcp://127.0.0.1:1" in done.stderr


def test_cluster_without_the_plugin(tmp_path):
    with LocalCluster(n_workers=1, processes=False, protocol="tcp", dashboard_address=":0") as cluster:
        done = run("record", "--scheduler", cluster.scheduler_address, "--duration", "0.5", "-o", str(tmp_path / "x.html"))
    assert done.returncode != 0
    assert "no dask-pyspy plugin" in done.stderr


def test_bad_output_fails_before_recording(client, tmp_path):
    done = run("record", "--scheduler", client.scheduler.address, "-o", str(tmp_path / "x.txt"))
    assert done.returncode != 0 and "path must end in" in done.stderr
