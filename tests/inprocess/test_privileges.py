"""Sampling needs no root, no capabilities and no ptrace; interpreters it cannot read are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = sysconfig.get_paths()["purelib"]

CHILD = """
import faulthandler, json, threading, time
from dask_pyspy import Sampler

def spin_unprivileged(stop):
    while not stop.is_set():
        sum(range(100))

with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f)
stop = threading.Event()
t = threading.Thread(target=spin_unprivileged, args=(stop,), name="spinner")
t.start()
s = Sampler(rate=200, cpu_budget=1.0, native=NATIVE)
s.start()
if HANDLER_AFTER:  # replaces the reader's fault handler: its reads go back to the system call
    faulthandler.enable()
deadline = time.time() + 60
while time.time() < deadline and (time.time() < deadline - 59 or NATIVE and s.stats()["native"]["merged"] < 5):
    time.sleep(0.1)
s.stop()
stop.set()
t.join()
names = {f["name"] for f in s.profile().speedscope()["shared"]["frames"]}
stats = s.stats()
print(json.dumps({"uid": status["Uid"].split()[0], "caps": status["CapEff"].strip(),
                  "found": "spin_unprivileged" in names, "ticks": stats["ticks"], "reader": stats["reader"],
                  "proc_mem": stats["reader_stats"].get("proc_mem_fallback"),
                  "reads_by": stats["reader_stats"].get("reads_by"),
                  "native": stats["native"]}))
"""


def run_child(prefix: list[str], python: str, native: bool = False, handler_after: bool = False) -> dict:
    env = {"PYTHONPATH": f"{ROOT}:{SITE}", "HOME": "/tmp", "PATH": "/usr/bin:/bin"}
    child = f"NATIVE, HANDLER_AFTER = {native}, {handler_after}\n{CHILD}"
    done = subprocess.run([*prefix, python, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs util-linux setpriv")
def test_unprivileged_user_without_capabilities():
    # Debian's python3 (same minor version as the venv), reachable by an unprivileged user.
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not Path(python).exists():
        pytest.fail(f"{python} is needed to run as another user (ci/test.sh installs it)")
    drop = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]
    result = run_child(drop, python, native=True)
    assert result["uid"] == "65534" and int(result["caps"], 16) == 0
    assert result["found"] and result["ticks"] > 0
    if sys.version_info >= (3, 11):
        assert result["reads_by"] == "copy", result  # no privilege needed for the fault handler
    # Native frames too: a signal to its own threads and a copy of their stacks.
    assert result["native"]["off"] is None and result["native"]["merged"] >= 5, result["native"]


@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_blocked_process_vm_readv_falls_back_to_proc_mem():
    """As under a seccomp profile that forbids process_vm_readv, where another fault handler
    keeps the reader from plain copies: it uses /proc/self/mem instead."""
    block = [
        "strace",
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "trace=process_vm_readv",
        "-e",
        "inject=process_vm_readv:error=EPERM",
    ]
    result = run_child(block, sys.executable, handler_after=True)
    assert result["found"] and result["ticks"] > 0
    if sys.version_info >= (3, 11):
        assert result["reader"] == "fast" and result["proc_mem"] is True, result
        assert result["reads_by"] == "/proc/self/mem", result
